"""A loader's start-up (``RemoteLoader._start``): each server described once, the plan checked
against what they said and the buffers against this machine's memory, and only then the
receiver opened and the buffers allocated; a refused connection retried until connect_timeout.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from remoteloader.client import RemoteLoader, memory_bounds
from remoteloader.client.host_delivery import HostDelivery
from remoteloader.client.option_groups import ConnectionOptions, FlowOptions, SecurityOptions
from remoteloader.client.options import LoaderOptions
from remoteloader.client.thread_receiver import ThreadReceiver, describe_servers
from remoteloader.protos import SERVICE, loader_pb2
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20
SAMPLES = 2 * 6


def resident() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def server(module_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    return module_cluster.address(module_cluster.add(make_imagefolder(root / "data", ["a", "b"], 6, size=(40, 48))))


# ---- checked before anything is allocated ---------------------------------------------------
@pytest.mark.parametrize("arguments, named", [
    (dict(batch_size=256, image_size=4096), "image_size=4096x4096"),  # 12.9 GB a batch; the server's max is 1024
    (dict(batch_size=10**7, image_size=64, prefetch=8), "batch_size=10000000, image_size=64x64, prefetch=8"),  # memory
])
def test_a_loader_the_servers_or_the_machine_cannot_hold_fails_within_a_second_allocating_nothing(
    server, arguments, named
):
    before, started = resident(), time.monotonic()
    with pytest.raises(ValueError, match=re.escape(named)):
        RemoteLoader(server, pipeline="eval", **arguments)
    took = time.monotonic() - started
    assert took < 1.0, f"refused after {took:.2f}s"
    assert resident() - before < 200 * MiB, f"{(resident() - before) / MiB:.0f} MiB taken before the refusal"


def test_the_memory_check_counts_the_buffers_as_the_docstring_does():
    options = LoaderOptions.from_arguments(dict(batch_size=10, image_size=8, prefetch=3))
    assert memory_bounds.buffer_bytes(options) == 5 * 10 * 8 * 8 * 3  # (prefetch + 2) uint8 batches
    unit = ((0,) * 3, (1,) * 3)
    normalized = LoaderOptions.from_arguments(dict(batch_size=10, image_size=8, prefetch=3, normalize=unit))
    assert memory_bounds.buffer_bytes(normalized) == 5 * 10 * 8 * 8 * 3 + 2 * 10 * 8 * 8 * 3 * 4  # two float32 ones
    need = memory_bounds.buffer_bytes(options)
    memory_bounds.check(options, available=int(need / memory_bounds.SHARE) + 1)  # fits
    with pytest.raises(ValueError, match="pass a smaller batch_size, image_size or prefetch"):
        memory_bounds.check(options, available=need)
    assert memory_bounds.available_bytes() > 0  # (Linux: MemAvailable)


# ---- each server described once ---------------------------------------------------------------
def test_a_receiver_starts_from_the_describes_the_loader_made_and_asks_no_server_again():
    calls = []
    answer = loader_pb2.DescribeResponse(num_shards=1, max_inflight_orders=2, max_order_samples=64)
    answer.shards.add(id="s", name="s", num_samples=3)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: calls.append(request) or answer,
        request_deserializer=loader_pb2.DescribeRequest.FromString,
        response_serializer=loader_pb2.DescribeResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Describe": handler}),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    connection = ConnectionOptions(connect_timeout=20, max_inflight=4)
    try:
        described = describe_servers(address, connection, SecurityOptions())
        assert len(calls) == 1 and list(described) == [address]
        buffers = HostDelivery(None, torch.float32, 2)
        receiver = ThreadReceiver(address, loader_pb2.Setup(), buffers, FlowOptions(), connection, SecurityOptions(),
                                  0, described)
        try:
            describes, new = receiver.discover()
            assert new == [address] and describes[address] == answer  # reported as new, once
            assert receiver.links[address].max_inflight == 2  # what the server allows, as a Describe sets it
            assert receiver.discover()[1] == []
            assert len(calls) == 1, "the receiver described the server again"
        finally:
            receiver.close()
            buffers.close(final=True)
    finally:
        server.stop(None)


# ---- a refused connection -------------------------------------------------------------------
class Said(logging.Handler):
    """Sets ``event`` when the client logs a line containing ``text``."""

    def __init__(self, text: str):
        super().__init__(logging.WARNING)
        self.text, self.event, self.lines = text, threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if self.text in line:
            self.event.set()


@pytest.fixture
def said():
    handlers = []

    def listen(text: str) -> Said:
        handler = Said(text)
        logging.getLogger("remoteloader.client").addHandler(handler)
        handlers.append(handler)
        return handler

    yield listen
    for handler in handlers:
        logging.getLogger("remoteloader.client").removeHandler(handler)


def test_a_port_where_nothing_listens_is_retried_until_connect_timeout_then_named(closed_port, said):
    address = f"127.0.0.1:{closed_port()}"
    log = said(f"{address} refused the connection; retrying for up to connect_timeout=3s")
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=re.escape(address) + " refused the connection: nothing listens there"):
        RemoteLoader(address, connect_timeout=3)
    took = time.monotonic() - started
    assert log.event.is_set(), log.lines  # said at once, not only at the end
    assert 2.5 <= took < 6, f"raised after {took:.1f}s with connect_timeout=3"


def test_a_loader_made_before_its_server_starts_trains(cluster, tmp_path, said, run_bounded):
    i = cluster.add(make_imagefolder(tmp_path / "data", ["a", "b"], 6, size=(40, 48)))
    address = cluster.address(i)
    cluster.stop(i)  # (its port is known: the server comes back on it)
    log = said(f"{address} refused the connection; retrying")
    made: dict = {}

    def make() -> None:
        try:
            made["loader"] = RemoteLoader(address, batch_size=4, image_size=24, pipeline="eval", connect_timeout=20)
        except BaseException as exc:
            made["error"] = exc

    started = time.monotonic()
    maker = threading.Thread(target=make)
    maker.start()
    assert log.event.wait(10), log.lines  # the loader is waiting: now the server starts (~2 s later)
    cluster.restart(i)
    maker.join(30)
    assert not maker.is_alive() and "error" not in made, made
    with made["loader"] as loader:
        batches = run_bounded(loader)
        assert sum(len(labels) for _, labels in batches) == SAMPLES
    assert time.monotonic() - started > 1.0  # (the server did start after the loader was made)
