"""Off the loopback: replicas behind links of different speeds, and orders another server sent first.

The shaped-link test runs two replicas of one shard, each in a network namespace of its own
behind a veth pair shaped with ``tc tbf`` (tools/shaped_links.py), bound to their
198.18.0.0/15 addresses with a token (and TLS in one case); it skips, naming the reason, where user and network
namespaces cannot be made. Its figure for the links' utilization is a loose bound, for a
shared 2-core machine: ``benchmarks/shaped_links.py`` measures it.
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
from conftest import Cluster

from remoteloader.protos import SERVICE, codec, loader_pb2, loader_pb2_grpc
from remoteloader.tools import shaped_links

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

STREAM = f"/{SERVICE}/Stream"


@pytest.mark.parametrize("rates, tls", [((40, 200), False), ((20, 200), True)], ids=["1:5 token", "1:10 TLS+token"])
def test_replicas_behind_shaped_links_share_an_epoch_by_link_speed_exactly_once(rates, tls):
    reason = shaped_links.available()
    if reason:
        pytest.skip(f"shaped links cannot be made here: {reason}")
    report = shaped_links.measure(list(rates), samples=8000, image_size=96, batch_size=64, tls=tls, timeout=200)
    assert report["samples"] == report["distinct"] == report["expected"] * 64, report  # exactly once
    slow = next(s for s in report["servers"].values() if s["rate_mbit"] == min(rates))
    assert slow["share"] > 0.5 * slow["ideal_share"], report  # the slow replica takes part ...
    assert slow["share"] < 1.5 * slow["ideal_share"], report  # ... by its link's speed
    assert report["utilization"] > 0.8, report  # (about 0.95 on a quiet machine)


def test_a_cancelled_order_sends_nothing_more_and_the_stream_goes_on(tmp_path):
    """Cancel stops an order's chunks not yet written; the stream serves the next order."""
    with Cluster(tmp_path / "logs", args=("--synthetic", "2000", "--max-rate", "40", "--chunk-bytes", "12288")) as c:
        c.add([])
        address = c.address(0)
        with grpc.insecure_channel(address) as channel:
            offer = loader_pb2_grpc.LoaderStub(channel).Describe(loader_pb2.DescribeRequest(), timeout=10)
            assert offer.cancels
            shard = offer.shards[0].id
            requests: queue.Queue = queue.Queue()
            requests.put(loader_pb2.StreamRequest(setup=loader_pb2.Setup(pipeline="eval", height=32, width=32)))
            requests.put(loader_pb2.StreamRequest(order=loader_pb2.Order(order_id=1, shard_ids=[shard],
                                                                         indices=list(range(200)))))
            method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                           response_deserializer=codec.decode_chunk)
            done = threading.Event()

            def requests_until_done():
                while not done.is_set():
                    try:
                        yield requests.get(timeout=0.1)
                    except queue.Empty:
                        continue

            received = {1: 0, 2: 0}
            for header, _pixels in method(requests_until_done(), timeout=60):
                received[header.order_id] += header.count
                if header.order_id == 1 and received[1] == header.count:  # its first chunk: cancel the rest
                    requests.put(loader_pb2.StreamRequest(cancel=loader_pb2.Cancel(order_id=1)))
                    requests.put(loader_pb2.StreamRequest(cancel=loader_pb2.Cancel(order_id=99)))  # unknown: ignored
                    requests.put(loader_pb2.StreamRequest(order=loader_pb2.Order(order_id=2, shard_ids=[shard],
                                                                                 indices=[0, 1, 2, 3])))
                if received[2] == 4:
                    done.set()
                    break
        assert received[2] == 4
        assert received[1] < 100, f"{received[1]} of the cancelled order's 200 samples were sent"  # 5 s at 40/s
