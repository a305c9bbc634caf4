"""The gRPC handlers (server/service.py) over real rooms and synthetic samples: a stream's Setup
is checked, its job registered (server/jobs.py) with the operator's weight while it is open and
closed after, and its orders served. The call's context stands in for gRPC's."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from remoteloader.protos import loader_pb2
from remoteloader.server.catalog import SyntheticShard
from remoteloader.server.config import ServerConfig
from remoteloader.server.jobs import Jobs
from remoteloader.server.pipeline_checks import PipelineChecks
from remoteloader.server.service import LoaderService
from remoteloader.server.shared_memory import Arena
from remoteloader.server.worker_pool import WorkerPool

pytestmark = pytest.mark.timeout(60)

SIZE = 16
SHARD = SyntheticShard(100)


class Ended(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details


class Call:
    """A Stream call: the client's messages, then EOF; at each chunk written, ``seen`` runs."""

    def __init__(self, requests, seen=lambda: None):
        self.requests = list(requests) + [grpc.aio.EOF]
        self.chunks: list = []
        self.seen = seen
        self.job = ""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    async def read(self):
        return self.requests.pop(0)

    async def write(self, chunk) -> None:
        self.seen()
        self.chunks.append(chunk)

    async def abort(self, code: grpc.StatusCode, details: str):
        raise Ended(code, details)


def setup(job: str = "") -> loader_pb2.StreamRequest:
    return loader_pb2.StreamRequest(setup=loader_pb2.Setup(pipeline="eval", height=SIZE, width=SIZE, job=job))


def order(order_id: int, indices: list[int]) -> loader_pb2.StreamRequest:
    return loader_pb2.StreamRequest(
        order=loader_pb2.Order(order_id=order_id, shard_ids=[SHARD.id], shards=[0] * len(indices), indices=indices)
    )


def serve(*calls: Call, seen_by=None, **settings) -> LoaderService:
    """Runs the calls' streams one after the other on one service, made as app.py makes it
    (20 s at most: they take milliseconds); ``seen_by(service)`` is each call's ``seen``."""
    config = ServerConfig(data=("-",), max_image_size=SIZE, min_image_size=SIZE, slots=6, **settings)
    arena = Arena(config.slots, config.slot_bytes)
    # (not started: synthetic samples are never decoded)
    pool = WorkerPool(arena, workers=1, allow_custom=False, max_pixels=10**6, jobs=Jobs(config.job_weights))
    checks = PipelineChecks(False, config.max_pixels, config.min_image_size, config.max_image_size, config.slot_bytes)
    service = LoaderService(config, [SHARD], pool, arena, None, checks)
    if seen_by is not None:
        for call in calls:
            call.seen = seen_by(service, call)

    async def run():
        for call in calls:
            await asyncio.wait_for(service.Stream(iter(()), call), 20)

    try:
        asyncio.run(run())
    finally:
        checks.close()
        arena.close()
    return service


def test_a_streams_job_is_registered_with_the_operators_weight_while_it_is_open():
    open_jobs: list[tuple] = []

    def seen_by(service: LoaderService, call: Call):
        job = call.job

        def seen():
            jobs = service.slots.jobs
            open_jobs.append((job, jobs.streams(job), jobs.weight(job)))

        return seen

    calls = [Call([setup("sweep"), order(1, [1, 2])]), Call([setup(), order(1, [3])])]
    calls[0].job, calls[1].job = "sweep", "#1"  # a stream that names no job is one of its own
    served = serve(*calls, seen_by=seen_by, job_weights="sweep=3")
    assert open_jobs == [("sweep", 1, 3.0), ("#1", 1, 1.0)]
    assert served.slots.jobs.total() == 0  # both closed
    assert [len(c.chunks) for c in calls] == [1, 1] and served.slots.arena.free == 6


@pytest.mark.parametrize(("first", "reason"), [
    (order(1, [1]), "the first message of a stream must be a Setup"),
    (setup("no spaces"), "Setup.job='no spaces'"),
])
def test_a_bad_setup_ends_the_stream_saying_why(first, reason):
    with pytest.raises(Ended) as ended:
        serve(Call([first]))
    assert ended.value.code == grpc.StatusCode.INVALID_ARGUMENT and reason in ended.value.details
