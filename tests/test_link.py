"""client/link.py without a server: a link resolves each chunk before its engine sees it
(counted, its order found, chunks of an order cancelled on its stream dropped) and gives an
order's credits and state as the engine reads them."""

from __future__ import annotations

import numpy as np

from remoteloader.client.assembly import Order
from remoteloader.client.batches import Batch
from remoteloader.client.link import Arrival, Link, LinkState
from remoteloader.client.option_groups import ConnectionOptions, SecurityOptions
from remoteloader.protos import codec, loader_pb2


class Events:
    """A link's engine that records what it is told."""

    def __init__(self):
        self.arrivals: list[Arrival] = []

    def on_chunk(self, link, arrival) -> None:
        self.arrivals.append(arrival)

    def on_link_down(self, link, orders, exc) -> None:
        pass

    def on_link_up(self, link) -> None:
        pass

    def on_link_lost(self, link) -> None:
        pass


def up_link(max_inflight: int = 4) -> Link:
    link = Link("127.0.0.1:1", Events(), ConnectionOptions(max_inflight=max_inflight), SecurityOptions())
    link.adopt(loader_pb2.DescribeResponse(max_inflight_orders=2, cancels=True))
    link.state = LinkState.UP  # (as open_stream leaves it; no stream here)
    return link


def order(order_id: int, n: int = 4) -> Order:
    images = np.zeros((n, 2, 2, 3), np.uint8)
    rows = np.arange(n)
    return Order(order_id, Batch(0, rows, images, images, np.zeros(n, np.int64), n), ("127.0.0.1:1",), rows, rows,
                 rows, 0)


def chunk(order_id: int, count: int, joined: bool = False) -> codec.DecodedChunk:
    header = loader_pb2.ChunkHeader(order_id=order_id, start=0, count=count, order_size=count, height=2, width=2,
                                    channels=3, labels=[0] * count, joined=joined)
    return codec.DecodedChunk(header, memoryview(bytes(count * 12)))


def test_the_server_lowers_the_credits_a_describe_allows():
    link = up_link(max_inflight=4)
    assert link.max_inflight == 2 and link.credits == 2
    link.send(order(1), loader_pb2.Order(order_id=1))
    assert link.credits == 1 and link.outstanding == 4 and link.order(1) is not None


def test_a_chunk_is_counted_and_resolved_to_its_order():
    link, wanted = up_link(), order(1)
    link.send(wanted, loader_pb2.Order(order_id=1))
    arrival = link._resolve(chunk(1, 4, joined=True))
    assert arrival is not None and arrival.order is wanted and arrival.release()  # (not shared: nothing to give back)
    assert link.bytes_received == 48 and link.samples_shared == 4
    stranger = link._resolve(chunk(99, 4))
    assert stranger is not None and stranger.order is None  # (the engine's check refuses it, failing the link)


def test_chunks_of_an_order_cancelled_on_the_stream_are_counted_and_dropped_before_the_engine():
    link, cancelled = up_link(), order(1)
    link.send(cancelled, loader_pb2.Order(order_id=1))
    cancelled.cancel()
    link.cancel(cancelled)
    assert link.order(1) is None and link.outstanding == 0
    assert link._resolve(chunk(1, 4)) is None
    assert link.bytes_received == 48 and link.samples_shared == 0
