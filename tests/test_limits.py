"""Server limits (streams per client and in all, order size, orders in flight), Prometheus
metrics, and the SIGTERM drain.

Two servers for the module:
    small   --max-streams-per-client 2 --max-order-samples 8 --max-inflight-orders 2
    metered --max-streams 3 --metrics-port -1 (a port it binds) --grace 2, with a few corrupt images
"""

from __future__ import annotations

import logging
import pathlib
import queue
import re
import threading
import time
import urllib.request

import grpc
import pytest
from conftest import ANY_PORT, _run_bounded, wait_until_equal
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remoteloader.client import RemoteLoader
from remoteloader.protos import codec, loader_pb2
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

STREAM = "/remoteloader.v1.Loader/Stream"
SIZE = 32
GOOD = 12  # 2 classes x 6
CORRUPT = {"b/empty.jpg": b"", "b/text.jpg": b"not a jpeg at all\n" * 20}
SMALL, METERED = 0, 1
ROOT = pathlib.Path(__file__).resolve().parents[1]


class Servers:
    def __init__(self, cluster, n_metered: int, n_corrupt: int):
        self.cluster = cluster
        self.metrics_port = cluster.metrics_port(METERED)
        self.n_metered = n_metered
        self.n_corrupt = n_corrupt

    def address(self, i: int) -> str:
        return self.cluster.address(i)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            return reply.read().decode()

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics: name -> value."""
        out = {}
        for line in self.metrics_text().splitlines():
            match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)", line)
            if match:
                out[match.group(1)] = float(match.group(2))
        return out


@pytest.fixture(scope="module")
def servers(module_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("limits")
    small = make_imagefolder(base / "small", ["a", "b"], 6, size=(48, 64), seed=1)
    metered = make_imagefolder(base / "metered", ["a", "b"], GOOD // 2, size=(48, 64), seed=2)
    valid = next((metered / "a").iterdir()).read_bytes()
    corrupt = dict(CORRUPT, **{"b/truncated.jpg": valid[: len(valid) // 3]})
    for key, data in corrupt.items():
        (metered / key).write_bytes(data)
    c = module_cluster
    # --max-rate: an order of 8 stays in flight 0.2 s, so that orders sent back to back find it
    # there even when a loaded machine delays the second (the tests of in-flight limits failed so).
    c.add(small, "--max-streams-per-client", "2", "--max-order-samples", "8", "--max-inflight-orders", "2",
          "--max-rate", "40", wait=False)
    c.add(metered, "--max-streams", "3", "--metrics-port", ANY_PORT, "--grace", "2", wait=False)
    c.wait_ready(SMALL)
    c.wait_ready(METERED)
    return Servers(c, GOOD + len(corrupt), len(corrupt))


# ---- raw streams ----------------------------------------------------------------------------
def _shard_id(channel) -> str:
    describe = channel.unary_unary("/remoteloader.v1.Loader/Describe",
                                   response_deserializer=loader_pb2.DescribeResponse.FromString)
    return describe(b"", timeout=10).shards[0].id


def _setup(pipeline: str = "eval", size: int = SIZE) -> loader_pb2.StreamRequest:
    """Exclusive: each stream renders its own chunks (server/sharing.py), so that what one stream
    holds, and how long its orders stay in flight under --max-rate, is its own."""
    return loader_pb2.StreamRequest(
        setup=loader_pb2.Setup(pipeline=pipeline, height=size, width=size, exclusive=True)
    )


def _order(order_id: int, shard_id: str, indices, seed: int = 0) -> loader_pb2.StreamRequest:
    return loader_pb2.StreamRequest(order=loader_pb2.Order(order_id=order_id, shard_ids=[shard_id],
                                                           indices=list(indices), seed=seed))


class OpenStream:
    """A Stream call kept open: requests go in through a queue, chunks come out of ``call``."""

    _END = object()

    def __init__(self, channel, timeout: float = 60):
        self.requests: queue.Queue = queue.Queue()
        method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                       response_deserializer=codec.decode_chunk)
        self.call = method(self._iterate(), timeout=timeout)

    def _iterate(self):
        while True:
            item = self.requests.get()
            if item is self._END:
                return
            yield item

    def send(self, request) -> None:
        self.requests.put(request)

    def receive(self, samples: int) -> list:
        chunks, got = [], 0
        while got < samples:
            chunk = next(self.call)
            chunks.append(chunk)
            got += chunk.header.count
        return chunks

    def close(self) -> None:
        self.requests.put(self._END)
        self.call.cancel()


def _finish(call) -> tuple[int, grpc.StatusCode, str]:
    """Reads a call to its end: (chunks received, status, details)."""
    chunks = 0
    try:
        for _ in call:
            chunks += 1
    except grpc.RpcError as exc:
        return chunks, exc.code(), exc.details() or ""
    return chunks, grpc.StatusCode.OK, ""


def _outcomes(calls: list, seconds: float) -> list[tuple[grpc.StatusCode, str] | None]:
    """How each call ended, once its buffered chunks are read; None for one still open after ``seconds``."""
    results: list = [None] * len(calls)

    def read(k: int, call) -> None:
        results[k] = _finish(call)[1:]

    readers = [threading.Thread(target=read, args=(k, call), daemon=True) for k, call in enumerate(calls)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + seconds
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    return list(results)


def _open_refused(channel, shard_id: str, count: int) -> list[tuple[int, grpc.StatusCode, str]]:
    """Opens ``count`` streams at once (each with a Setup and an order); returns how each ended."""
    method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                   response_deserializer=codec.decode_chunk)
    calls = [method(iter([_setup(), _order(1, shard_id, [0])]), timeout=20) for _ in range(count)]
    return [_finish(call) for call in calls]


def _admitted_streams(channel, shard_id: str, count: int) -> list[OpenStream]:
    """``count`` streams held open, each admitted and served one sample."""
    streams = [OpenStream(channel) for _ in range(count)]
    for n, stream in enumerate(streams):
        stream.send(_setup())
        stream.send(_order(1, shard_id, [n]))
        assert sum(c.header.count for c in stream.receive(1)) == 1
    return streams


def _bounded_epoch(loader, seconds: float, after_first=None) -> list[int]:
    """Iterates one epoch (closing the loader and failing after ``seconds``); returns the ids.

    ``after_first`` runs once the first batch is in, while the rest of the epoch streams."""
    def check(n, batch) -> None:
        assert tuple(batch[0].shape[1:]) == (SIZE, SIZE, 3)
        if n == 0 and after_first is not None:
            after_first()

    return [i for _images, _labels, ids in _run_bounded(loader, seconds, check) for i in ids.tolist()]


# ---- stream limits --------------------------------------------------------------------------
def test_streams_over_the_per_client_limit_are_refused_and_admitted_ones_are_served(servers):
    with grpc.insecure_channel(servers.address(SMALL)) as channel:
        shard_id = _shard_id(channel)
        admitted = OpenStream(channel)
        try:
            admitted.send(_setup())
            admitted.send(_order(1, shard_id, [0, 1, 2]))
            assert sum(c.header.count for c in admitted.receive(3)) == 3
            outcomes: list = []
            loader = RemoteLoader(servers.address(SMALL), batch_size=4, image_size=SIZE, pipeline="eval",
                                  drop_last=False, return_ids=True, connect_timeout=10)
            with loader:
                # The loader's stream is this client's second: admitted. 25 more are not.
                ids = _bounded_epoch(loader, 60, lambda: outcomes.extend(_open_refused(channel, shard_id, 25)))
            assert sorted(ids) == list(range(12)), "the admitted loader did not get every sample exactly once"
            assert len(outcomes) == 25
            for chunks, code, details in outcomes:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
                assert chunks == 0
                assert "max_streams_per_client=2" in details, details
            # The first admitted stream is still served.
            admitted.send(_order(2, shard_id, [3, 4]))
            chunks = admitted.receive(2)
            assert [c.header.order_id for c in chunks] == [2] * len(chunks)
        finally:
            admitted.close()
        # Closed streams free their places: a new one is admitted again.
        deadline = time.monotonic() + 10
        while True:
            chunks, code, details = _finish(channel.stream_stream(
                STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                response_deserializer=codec.decode_chunk)(iter([_setup(), _order(1, shard_id, [5])]), timeout=10))
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert code == grpc.StatusCode.OK and chunks == 1, (code, details)


def test_a_server_that_refuses_every_new_stream_is_retried_with_back_off(servers, caplog):
    # Both of this client's places are taken: the loader's stream is refused each time it
    # is opened. Its retries must back off (they were 10 a second) until reconnect_timeout.
    from remoteloader.client.engine import LoaderError

    with grpc.insecure_channel(servers.address(SMALL)) as channel:
        shard_id = _shard_id(channel)
        held = _admitted_streams(channel, shard_id, 2)
        try:
            caplog.set_level(logging.WARNING, logger="remoteloader.client")
            with RemoteLoader(servers.address(SMALL), batch_size=4, image_size=SIZE, pipeline="eval",
                              reconnect_timeout=4, connect_timeout=10, return_ids=True) as loader:
                started = time.monotonic()
                with pytest.raises(LoaderError):
                    _bounded_epoch(loader, 30)
                elapsed = time.monotonic() - started
        finally:
            for stream in held:
                stream.close()
    refusals = [r for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage() and r.levelno == logging.WARNING]
    assert 3.5 < elapsed < 20, elapsed
    assert 1 <= len(refusals) <= 8, f"{len(refusals)} refusals in {elapsed:.1f}s: no back-off"


def test_streams_over_the_server_limit_are_refused_and_counted(servers):
    before = servers.metrics()
    with grpc.insecure_channel(servers.address(METERED)) as channel:
        shard_id = _shard_id(channel)
        held = _admitted_streams(channel, shard_id, 2)
        try:
            outcomes: list = []
            with RemoteLoader(servers.address(METERED), batch_size=5, image_size=SIZE, pipeline="eval",
                              drop_last=False, return_ids=True, on_error="skip", connect_timeout=10) as loader:
                ids = _bounded_epoch(loader, 60, lambda: outcomes.extend(_open_refused(channel, shard_id, 30)))
            assert len(set(ids)) == len(ids) == GOOD
            for chunks, code, details in outcomes:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and chunks == 0, (code, details)
                assert "max_streams=3" in details, details
        finally:
            for stream in held:
                stream.close()
    refused = "remoteloader_refused_streams_total"
    wait_until_equal(lambda: servers.metrics()[refused] - before[refused], 30, "streams refused, by the server's count")


# ---- order limits ---------------------------------------------------------------------------
def test_an_order_over_max_order_samples_is_refused(servers):
    with grpc.insecure_channel(servers.address(SMALL)) as channel:
        shard_id = _shard_id(channel)
        method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                       response_deserializer=codec.decode_chunk)
        for indices in (list(range(9)), [0] * 1000, []):
            chunks, code, details = _finish(method(iter([_setup(), _order(7, shard_id, indices)]), timeout=20))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and chunks == 0, (code, details)
            assert "max_order_samples" in details and "1..8" in details, details
        # Exactly the limit is fine.
        chunks, code, details = _finish(method(iter([_setup(), _order(7, shard_id, range(8))]), timeout=20))
        assert code == grpc.StatusCode.OK, details


def test_more_orders_in_flight_than_allowed_are_refused(servers):
    with grpc.insecure_channel(servers.address(SMALL)) as channel:
        shard_id = _shard_id(channel)
        method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                       response_deserializer=codec.decode_chunk)
        # Six orders at once, nothing read in between: the third finds two in flight.
        requests = [_setup("train", 128)] + [_order(k, shard_id, range(8)) for k in range(1, 7)]
        call = method(iter(requests), timeout=20)
        chunks, code, details = _finish(call)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "max_inflight_orders=2" in details, details
    assert chunks <= 2 * 8


def test_an_order_id_already_in_flight_is_refused(servers):
    """Two orders in flight with one id: their chunks, a Cancel and their ends could not be told apart."""
    with grpc.insecure_channel(servers.address(SMALL)) as channel:
        shard_id = _shard_id(channel)
        method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                       response_deserializer=codec.decode_chunk)
        requests = [_setup("train", 128), _order(3, shard_id, range(8)), _order(3, shard_id, range(8))]
        chunks, code, details = _finish(method(iter(requests), timeout=20))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "order 3 is already in flight" in details, details
    assert chunks <= 8


def test_orders_within_every_limit_are_served(servers):
    """max_order_samples-sized orders, several in flight on one stream: all within the limits."""
    with grpc.insecure_channel(servers.address(METERED)) as channel:
        shard_id = _shard_id(channel)
        method = channel.stream_stream(STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                       response_deserializer=codec.decode_chunk)
        orders, per_order = 4, 1024  # the defaults allow 1024 samples per order and 16 orders in flight
        indices = [i % GOOD for i in range(per_order)]  # the good images only
        requests = [_setup("train", 64)] + [_order(k, shard_id, indices) for k in range(1, orders + 1)]
        received = {k: 0 for k in range(1, orders + 1)}
        code, details = grpc.StatusCode.OK, ""
        try:
            for header, pixels in method(iter(requests), timeout=60):
                assert len(pixels) == header.count * 64 * 64 * 3 and not header.errors
                received[header.order_id] += header.count
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
    assert code == grpc.StatusCode.OK, f"{code.name}: {details} after {received}"
    assert received == {k: per_order for k in received}


def test_a_client_that_never_reads_cannot_starve_the_others(servers):
    """One stream fills the server with large orders and never reads its chunks; another
    client's epoch must still be served (each stream holds at most its share of the slots)."""
    with grpc.insecure_channel(servers.address(METERED)) as channel:
        shard_id = _shard_id(channel)
        hog = OpenStream(channel, timeout=120)
        try:
            hog.send(_setup("eval", 512))  # 768 KiB per sample: a few samples fill a slot
            for k in range(1, 17):
                hog.send(_order(k, shard_id, [i % GOOD for i in range(64)]))
            time.sleep(2)  # let it take what it can
            with RemoteLoader(servers.address(METERED), batch_size=4, image_size=SIZE, pipeline="eval",
                              shuffle=False, drop_last=False, return_ids=True, on_error="skip") as loader:
                ids = _bounded_epoch(loader, 60)
            assert sorted(ids) == sorted(set(ids)) and len(ids) == GOOD
        finally:
            hog.close()


def test_streams_that_never_read_are_ended_when_others_wait_for_their_slots(servers):
    """Two streams take every slot between them and never read: a third client must be
    served after CONTENDED_STALL (10 s), well before stall_timeout (120 s) ends them."""
    with grpc.insecure_channel(servers.address(METERED)) as channel:
        shard_id = _shard_id(channel)
        hogs = [OpenStream(channel, timeout=120) for _ in range(2)]
        try:
            for n, hog in enumerate(hogs):
                hog.send(_setup("eval", 512))  # 768 KiB per sample: a few samples fill a slot
                for k in range(1, 17):  # (seeds of their own: no chunk is another's, each takes a slot)
                    hog.send(_order(k, shard_id, [i % GOOD for i in range(64)], seed=100 * n + k))
            time.sleep(2)  # let them take what they can
            started = time.monotonic()
            with RemoteLoader(servers.address(METERED), batch_size=4, image_size=SIZE, pipeline="eval",
                              shuffle=False, drop_last=False, return_ids=True, on_error="skip") as loader:
                ids = _bounded_epoch(loader, 50)
            assert sorted(ids) == sorted(set(ids)) and len(ids) == GOOD
            assert time.monotonic() - started < 40
            # Ended while the loader waited: one at least (once one hog's slots came back, the
            # loader may have needed none of the other's).
            ended = _outcomes([hog.call for hog in hogs], 15)
            assert any(o and o[0] == grpc.StatusCode.DEADLINE_EXCEEDED and "waited for the chunk slots it holds"
                       in o[1] for o in ended), ended
        finally:
            for hog in hogs:
                hog.close()


def test_a_stream_that_stops_reading_is_ended_after_stall_timeout(cluster, tmp_path):
    data = make_imagefolder(tmp_path / "stall", ["a"], 8, size=(48, 64), seed=5)
    index = cluster.add(data, "--stall-timeout", "2")
    with grpc.insecure_channel(cluster.address(index)) as channel:
        shard_id = _shard_id(channel)
        hog = OpenStream(channel, timeout=60)
        try:
            hog.send(_setup("eval", 512))  # big chunks: gRPC's buffers fill and the writes block
            for k in range(1, 9):
                hog.send(_order(k, shard_id, list(range(8))))
            cluster.wait_for_log(index, r"stall_timeout", 30)
            with pytest.raises(grpc.RpcError) as info:
                for _ in hog.call:
                    pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "stall_timeout=2" in info.value.details()
        finally:
            hog.close()
        # A stream that never sends its Setup does not keep its place among max_streams.
        silent = OpenStream(channel, timeout=60)
        try:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                for _ in silent.call:
                    pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no Setup within stall_timeout=2s" in info.value.details()
            assert time.monotonic() - started < 20
        finally:
            silent.close()


# ---- metrics --------------------------------------------------------------------------------
def test_metrics_count_exactly_what_an_epoch_served(servers):
    names = servers.metrics()
    for name in ("remoteloader_images_served_total", "remoteloader_bytes_served_bytes_total",
                 "remoteloader_decode_errors_total", "remoteloader_active_streams", "remoteloader_orders_total",
                 "remoteloader_refused_streams_total", "remoteloader_queue_depth",
                 "remoteloader_order_duration_seconds_count"):
        assert name in names, f"{name} not in /metrics: {sorted(names)}"
    # The names the deployment notes promise are the names served.
    notes = (ROOT / "docs" / "deploy.md").read_text()
    promised = set(re.findall(r"`(remoteloader_[a-z_]+)`", notes))
    assert promised, "docs/deploy.md lists no metric names"
    text = servers.metrics_text()
    for name in promised:
        assert re.search(rf"^{name}(_bucket|_count|_sum)?[ {{]", text, re.M), f"{name} (docs/deploy.md) not served"

    before = servers.metrics()
    failures = []
    with RemoteLoader(servers.address(METERED), batch_size=4, image_size=SIZE, pipeline="eval", drop_last=False,
                      return_ids=True, on_error=failures.extend, connect_timeout=10) as loader:
        ids = _bounded_epoch(loader, 60)
        assert servers.metrics()["remoteloader_active_streams"] == 1
        n = servers.n_metered
        # A chunk is counted once its write completes, which the server may learn after the
        # client has it (and never, if the stream is closed meanwhile): read, stream open, until
        # the last ones are.
        counted = ("remoteloader_images_served_total", "remoteloader_bytes_served_bytes_total",
                   "remoteloader_decode_errors_total")

        def delta() -> dict[str, float]:
            after = servers.metrics()
            return {k: after[k] - before.get(k, 0.0) for k in after}

        wait_until_equal(lambda: tuple(delta()[k] for k in counted), (n, n * SIZE * SIZE * 3, servers.n_corrupt),
                         f"{counted} over the epoch")

        def untimed() -> float:
            d = delta()
            assert d["remoteloader_orders_total"] > 0
            return d["remoteloader_orders_total"] - d["remoteloader_order_duration_seconds_count"]

        wait_until_equal(untimed, 0.0, "orders counted but not timed")
    assert sorted(ids) == list(range(n))
    assert len(failures) == servers.n_corrupt
    deadline = time.monotonic() + 10
    while servers.metrics()["remoteloader_active_streams"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert servers.metrics()["remoteloader_active_streams"] == 0, "the closed loader's stream is still counted"

    # A loader closed after one batch leaves work behind; once it is done, the queue reads empty.
    with RemoteLoader(servers.address(METERED), batch_size=1, image_size=SIZE, pipeline="eval", drop_last=False,
                      on_error="skip", connect_timeout=10) as loader:
        next(iter(loader))
    deadline = time.monotonic() + 10
    while servers.metrics()["remoteloader_queue_depth"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert servers.metrics()["remoteloader_queue_depth"] == 0, "an idle server reports queued work"


# ---- SIGTERM --------------------------------------------------------------------------------
def test_sigterm_drains_health_goes_not_serving_and_exits_0(servers):
    cluster = servers.cluster
    statuses: list[tuple[float, int]] = []
    watching = threading.Event()
    with grpc.insecure_channel(servers.address(METERED)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def watch() -> None:
            try:
                for reply in stub.Watch(health_pb2.HealthCheckRequest(service="remoteloader.v1.Loader"), timeout=30):
                    statuses.append((time.monotonic(), reply.status))
                    watching.set()
            except grpc.RpcError:
                pass
            finally:
                watching.set()

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        assert watching.wait(10) and statuses and statuses[0][1] == health_pb2.HealthCheckResponse.SERVING
        sent = time.monotonic()
        code = cluster.stop(METERED, timeout=30)
        thread.join(10)
    assert code == 0, cluster.servers[METERED].process.stderr()[-3000:]
    not_serving = [t for t, s in statuses if s == health_pb2.HealthCheckResponse.NOT_SERVING]
    assert not_serving, f"health never reported NOT_SERVING after SIGTERM: {statuses}"
    assert not_serving[0] - sent < 5
    log = cluster.servers[METERED].process.stderr()
    assert "draining" in log and "stopped" in log
