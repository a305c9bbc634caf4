"""server.delivery: a stream's chunks in their gRPC messages, or left in the shared memory with
their slots lent to the same-host client until it releases them."""

from __future__ import annotations

import asyncio

from remoteloader.protos import loader_pb2
from remoteloader.server.config import ServerConfig
from remoteloader.server.delivery import PayloadDelivery, SharedDelivery
from remoteloader.server.shared_memory import Arena
from remoteloader.server.sharing import SharedRenders
from remoteloader.server.slots import Slots
from remoteloader.server.stalls import Stalls

CONFIG = ServerConfig(data=("-",), slots=6)


def test_a_payload_delivery_sends_the_pixels_lends_nothing_and_refuses_releases():
    delivery = PayloadDelivery()
    pixels = memoryview(b"abc")
    header = loader_pb2.ChunkHeader()
    assert delivery.lend(3) is None
    assert delivery.place(header, 3, 3, None, pixels) is pixels and not header.HasField("shared")
    assert "did not ask for shared_memory" in delivery.release(loader_pb2.Release(tickets=[1]))
    assert not delivery.reads_releases
    assert delivery.chunk_bytes(CONFIG) == CONFIG.stream_chunk_bytes(False)


def test_a_shared_delivery_lends_each_slot_says_where_it_lies_and_takes_releases_by_ticket():
    async def run():
        arena = Arena(6, 4096)
        try:
            slots = Slots(arena)
            stream = slots.open("#1")
            delivery = SharedDelivery(Stalls(slots, 60), SharedRenders(slots), stream, arena)
            taken = []
            for _ in range(2):
                await slots.room(stream)
                taken.append(await slots.acquire(stream))
            tickets = [delivery.lend(slot) for slot in taken]
            assert tickets == [1, 2] and delivery.reads_releases
            header = loader_pb2.ChunkHeader()
            assert len(delivery.place(header, taken[1], 100, tickets[1], memoryview(b"x" * 100))) == 0
            assert (header.shared.offset, header.shared.length, header.shared.ticket) == (
                arena.offset(taken[1]),
                100,
                2,
            )
            assert header.shared.generation == arena.generation(taken[1])
            assert delivery.release(loader_pb2.Release(tickets=[1])) is None and arena.free == 5
            assert "ticket 1" in delivery.release(loader_pb2.Release(tickets=[1]))  # released already
            queue: asyncio.Queue = asyncio.Queue()
            delivery.fail("end", queue)
            delivery.fail("later", queue)  # (the first failure is how it ends)
            assert await delivery.next(queue) == "end" and queue.qsize() == 1
            await asyncio.wait_for(delivery.before_end("end"), 5)  # failed: no wait for the loans
            delivery.end()
            assert arena.free == 6 and stream.held == 0
            assert delivery.chunk_bytes(CONFIG) == CONFIG.stream_chunk_bytes(True)
        finally:
            arena.close()

    asyncio.run(asyncio.wait_for(run(), 10))
