"""One order stream (server/order_stream.py) over the server's real rooms (slots, sharing, stall
rules, renderer) and synthetic samples, which are never decoded: orders in, chunks out, in
order; bad orders end the stream with a status that says why; a Cancel stops an order; shared
memory lends each chunk's slot until its Release. The call's context stands in for gRPC's."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from remoteloader.protos import limits, loader_pb2
from remoteloader.server.catalog import Catalog, SyntheticShard
from remoteloader.server.config import ServerConfig
from remoteloader.server.fetching import Fetcher
from remoteloader.server.metrics import Metrics
from remoteloader.server.order_stream import OrderStream, StreamRooms
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.render import Renderer
from remoteloader.server.shared_memory import Arena
from remoteloader.server.sharing import SharedRenders
from remoteloader.server.slots import Slots
from remoteloader.server.stalls import Stalls
from remoteloader.server.worker_pool import WorkerPool

pytestmark = pytest.mark.timeout(60)

SIZE = 16
SPEC = PipelineSpec("eval", SIZE, SIZE)
SHARD = SyntheticShard(1000)
CATALOG = Catalog([SHARD])


class Ended(Exception):
    """The stream was ended (context.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details


class Call:
    """The Stream call as the OrderStream sees it: the client's messages in, the chunks out."""

    def __init__(self, requests: list[loader_pb2.StreamRequest], then_eof: bool = True, read_first: bool = False):
        self.requests: asyncio.Queue = asyncio.Queue()
        for request in requests:
            self.requests.put_nowait(request)
        if then_eof:
            self.requests.put_nowait(grpc.aio.EOF)
        self.chunks: list = []
        self.read_first = read_first  # the client takes no chunk before the server has read all its messages
        self._all_read = asyncio.Event()

    async def read(self):
        request = await self.requests.get()
        if self.requests.empty():
            self._all_read.set()
        return request

    async def write(self, chunk) -> None:
        if self.read_first:
            await self._all_read.wait()
            for _ in range(20):  # (the server handles the last one in a few turns of the loop, without I/O)
                await asyncio.sleep(0)
        self.chunks.append(chunk)

    async def abort(self, code: grpc.StatusCode, details: str):
        raise Ended(code, details)


def order(order_id: int, indices: list[int]) -> loader_pb2.StreamRequest:
    return loader_pb2.StreamRequest(
        order=loader_pb2.Order(order_id=order_id, shard_ids=[SHARD.id], shards=[0] * len(indices), indices=indices)
    )


async def serve(call: Call, shared: bool = False, **settings) -> tuple[StreamRooms, Arena]:
    """Runs one stream to its end over fresh rooms (20 s at most: it takes milliseconds)."""
    config = ServerConfig(data=("-",), max_image_size=SIZE, min_image_size=SIZE, slots=6, **settings)
    arena = Arena(config.slots, config.slot_bytes)
    slots = Slots(arena)
    pool = WorkerPool(arena, workers=1, allow_custom=False, max_pixels=10**6)  # (not started: never used)
    rooms = StreamRooms(
        config, CATALOG, Fetcher(CATALOG, None), Renderer(CATALOG, pool, None), slots, SharedRenders(slots),
        Stalls(slots, config.stall_timeout), None, Metrics(), asyncio.Event(),
    )
    stream = OrderStream(call, "test", SPEC, rooms, job="#1", job_label="(none)", exclusive=False, shared=shared)
    try:
        await asyncio.wait_for(stream.run(), 20)
    finally:
        arena.close()
    return rooms, arena


def test_orders_come_back_as_chunks_in_order_and_every_slot_goes_back():
    per_chunk, sample = 4, limits.sample_bytes(SIZE, SIZE)  # (chunk_bytes below)
    assert limits.samples_per_chunk(per_chunk * sample, sample, False) == per_chunk
    big = list(range(per_chunk + 3))  # two chunks
    call = Call([order(1, big), order(2, [7, 8])])

    async def run():
        rooms, arena = await serve(call, chunk_bytes=per_chunk * sample)
        return rooms, arena.free

    rooms, free = asyncio.run(run())
    heads = [(c.header.order_id, c.header.start, c.header.count) for c in call.chunks]
    assert heads == [(1, 0, per_chunk), (1, per_chunk, 3), (2, 0, 2)]
    assert list(call.chunks[2].header.labels) == [SHARD.labels[7], SHARD.labels[8]]
    assert all(len(c.pixels) == c.header.count * SIZE * SIZE * 3 for c in call.chunks)
    assert free == 6 and rooms.slots.jobs.streams("#1") == 0  # every slot back, the job closed


@pytest.mark.parametrize(("requests", "code", "reason"), [
    ([order(1, [])], grpc.StatusCode.INVALID_ARGUMENT, "has 0 samples"),
    ([order(1, [5000])], grpc.StatusCode.INVALID_ARGUMENT, "order 1:"),
    ([loader_pb2.StreamRequest(setup=loader_pb2.Setup())], grpc.StatusCode.INVALID_ARGUMENT, "only the first"),
    ([loader_pb2.StreamRequest(release=loader_pb2.Release(tickets=[1]))], grpc.StatusCode.INVALID_ARGUMENT,
     "did not ask for shared_memory"),
])
def test_a_bad_message_ends_the_stream_saying_why(requests, code, reason):
    call = Call(requests, then_eof=False)
    with pytest.raises(Ended) as ended:
        asyncio.run(serve(call))
    assert ended.value.code == code and reason in ended.value.details, ended.value.details


def test_orders_over_the_in_flight_limit_are_refused():
    # the client reads no chunk before all three orders are in: two are in flight when the third comes
    call = Call([order(i, [i]) for i in range(1, 4)], then_eof=False, read_first=True)
    with pytest.raises(Ended) as ended:
        asyncio.run(serve(call, max_inflight_orders=2))
    assert ended.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than max_inflight_orders=2 orders in flight" in ended.value.details
    assert [c.header.order_id for c in call.chunks] == [1, 2]  # the orders before it are served first


def test_shared_memory_lends_each_chunks_slot_until_its_release():
    call = Call([order(1, [1, 2, 3])], then_eof=False)

    async def run():
        task = asyncio.ensure_future(serve(call, shared=True))
        while not call.chunks:
            await asyncio.sleep(0.001)
        header = call.chunks[0].header
        assert header.shared.ticket == 1 and header.shared.length == 3 * SIZE * SIZE * 3
        assert len(call.chunks[0].pixels) == 0  # the pixels stay in the slot
        call.requests.put_nowait(loader_pb2.StreamRequest(release=loader_pb2.Release(tickets=[1])))
        call.requests.put_nowait(grpc.aio.EOF)
        rooms, arena = await task
        return arena.free

    assert asyncio.run(run()) == 6
