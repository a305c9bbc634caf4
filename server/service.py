"""The gRPC service ``remoteloader.v1.Loader``: Describe, GetKeys and the order/chunk Stream.

The handlers are thin: each checks its request and hands the work to the module whose job
it is (admission for stream limits, pipeline_checks for the Setup, order_stream for the
orders). The service owns nothing that must be closed: app.RenderResources creates the
worker pool, arena, cache and pipeline checks, and app.LoaderServer closes them after the
service has drained.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from remoteloader.protos import SERVICE, loader_pb2
from remoteloader.protos.jobs import job_name_error
from remoteloader.server.admission import StreamAdmission, client_address
from remoteloader.server.catalog import Catalog, Shard
from remoteloader.server.config import ServerConfig
from remoteloader.server.describe import ShardPages
from remoteloader.server.fetching import Fetcher
from remoteloader.server.metrics import Metrics
from remoteloader.server.object_cache import ObjectCache
from remoteloader.server.order_stream import OrderStream, StreamRooms, serialize_chunk
from remoteloader.server.pipeline_checks import OFFERED, PipelineChecks
from remoteloader.server.pipelines import PipelineError
from remoteloader.server.rate_limit import RateLimiter
from remoteloader.server.read_ahead import ReadAhead
from remoteloader.server.render import Renderer
from remoteloader.server.shared_memory import Arena, SampleCache
from remoteloader.server.sharing import SharedRenders
from remoteloader.server.slots import Slots
from remoteloader.server.stalls import Stalls
from remoteloader.server.worker_pool import WorkerPool

VERSION = "0.2.0"  # 0.2: Describe in pages with class lists once; orders over several shards
MAX_KEYS_PER_CALL = 10_000

log = logging.getLogger(__name__)


class LoaderService:
    """Serves the shards of one server through a worker pool.

    Args:
        config: The server's settings.
        shards: The shards it serves.
        pool: The decode workers (not started when it serves only synthetic shards).
        arena: The shared chunk slots.
        cache: The shared cache of encoded samples, if any.
        checks: Builds and checks the pipelines Setups ask for.
        objects: The local copies of object-store samples, where shards are in a store.
    """

    def __init__(
        self,
        config: ServerConfig,
        shards: list[Shard],
        pool: WorkerPool,
        arena: Arena,
        cache: SampleCache | None,
        checks: PipelineChecks,
        objects: ObjectCache | None = None,
        read_ahead: ReadAhead | None = None,
    ):
        self.config = config
        self.catalog = Catalog(shards)
        self.pages = ShardPages(shards)
        self.checks = checks
        self.admission = StreamAdmission(config.max_streams, config.max_streams_per_client)
        self.slots = Slots(arena, pool.jobs)
        self.renders = SharedRenders(self.slots)
        self._streams = itertools.count(1)  # numbers the streams: a stream that names no job is "#n"
        self.fetcher = Fetcher(self.catalog, objects, read_ahead)
        self.renderer = Renderer(self.catalog, pool, cache)
        self.limiter = RateLimiter(config.max_rate) if config.max_rate else None
        self.metrics = Metrics()
        self.metrics.queue_depth.set_function(lambda: pool.outstanding)
        self.metrics.active_streams.set_function(lambda: self.admission.active)
        self.metrics.workers_busy.set_function(pool.busy_share)
        self.metrics.worker_busy_seconds.set_function(pool.busy_seconds)
        self.metrics.workers.set_function(lambda: pool.workers)
        if objects is not None:
            self.metrics.store_bytes.set_function(lambda: objects.stats.fetched_bytes)
            self.metrics.store_requests.set_function(lambda: objects.stats.requests)
            self.metrics.store_failures.set_function(lambda: objects.stats.failures)
            self.metrics.disk_cache_bytes.set_function(lambda: objects.held)
        self._draining = asyncio.Event()
        stalls = Stalls(self.slots, config.stall_timeout)
        self.rooms = StreamRooms(
            config,
            self.catalog,
            self.fetcher,
            self.renderer,
            self.slots,
            self.renders,
            stalls,
            self.limiter,
            self.metrics,
            self._draining,
        )
        # The same-host socket Describe offers (app._offer_local) and the host it is on; "": none.
        self.local_socket = ""
        self.host_id = ""

    def offer_local(self, address: str, host_id: str) -> None:
        """Describe offers ``address`` (``@name``), a socket on the host ``host_id``, and streams
        may ask for shared memory."""
        self.local_socket, self.host_id = address, host_id

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Describe": grpc.unary_unary_rpc_method_handler(
                    self.Describe,
                    request_deserializer=loader_pb2.DescribeRequest.FromString,
                    response_serializer=loader_pb2.DescribeResponse.SerializeToString,
                ),
                "GetKeys": grpc.unary_unary_rpc_method_handler(
                    self.GetKeys,
                    request_deserializer=loader_pb2.GetKeysRequest.FromString,
                    response_serializer=loader_pb2.GetKeysResponse.SerializeToString,
                ),
                "Stream": grpc.stream_stream_rpc_method_handler(
                    self.Stream,
                    request_deserializer=loader_pb2.StreamRequest.FromString,
                    response_serializer=serialize_chunk,
                ),
            },
        )

    def drain(self) -> None:
        """Stops taking new orders; streams finish what they hold, then end UNAVAILABLE."""
        self._draining.set()

    async def Describe(
        self, request: loader_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> loader_pb2.DescribeResponse:
        c = self.config
        response = loader_pb2.DescribeResponse(
            version=VERSION,
            pipelines=list(OFFERED),
            custom_pipelines=c.allow_custom_pipelines,
            min_image_size=c.min_image_size,
            max_image_size=c.max_image_size,
            max_order_samples=c.max_order_samples,
            max_inflight_orders=c.max_inflight_orders,
            chunk_bytes=c.chunk_bytes,
            cancels=True,
            workers=c.workers,
            wires=self.checks.wires,
            local_socket=self.local_socket,
            host_id=self.host_id,
        )
        try:
            self.pages.fill(response, request.shard_start)
        except ValueError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return response

    async def GetKeys(
        self, request: loader_pb2.GetKeysRequest, context: grpc.aio.ServicerContext
    ) -> loader_pb2.GetKeysResponse:
        shard = self.catalog.get(request.shard_id)
        if shard is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"no shard {request.shard_id!r} on this server")
        if request.count > MAX_KEYS_PER_CALL:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"count={request.count} is over the limit of {MAX_KEYS_PER_CALL} keys per call",
            )
        end = min(request.start + request.count, len(shard))
        return loader_pb2.GetKeysResponse(keys=[shard.key(i) for i in range(request.start, end)])

    async def Stream(
        self, request_iterator: AsyncIterator[loader_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> None:
        peer = context.peer()
        client = client_address(peer)
        refusal = self.admission.refusal(client)
        if refusal is not None:
            self.metrics.refused.inc()
            await _abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many open streams: this server's limit is {refusal}"
            )
        with self.admission.hold(client):
            setup = await self._read_setup(context)
            if setup is None:
                return
            try:
                pipeline = await self.checks.get(setup)
            except PipelineError as exc:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            spec = pipeline.spec
            job_error = job_name_error(setup.job)
            if job_error:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Setup.{job_error}")
            job = setup.job or f"#{next(self._streams)}"  # (no name: a job of its own)
            weight = self.slots.jobs.weighed(setup.job)  # None: 1 for each stream of the job
            if setup.shared_memory and not self.local_socket:
                await _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "shared_memory: this server offers no local socket (--local-socket false, or it "
                    "cannot tell which host it is on); leave shared_memory unset",
                )
            log.info(
                "stream opened by %s: pipeline %s %dx%d%s, job %s (weight %s)%s",
                peer,
                spec.name,
                spec.height,
                spec.width,
                ", shared memory" if setup.shared_memory else "",
                job,
                "1 a stream" if weight is None else f"{weight:g}",
                ", exclusive" if setup.exclusive else "",
            )
            await OrderStream(
                context,
                peer,
                spec,
                self.rooms,
                job=job,
                job_label=self.metrics.job_label(setup.job),
                exclusive=setup.exclusive,
                shared=setup.shared_memory,
            ).run()

    async def _read_setup(self, context: grpc.aio.ServicerContext) -> loader_pb2.Setup | None:
        """The stream's first message, its Setup; None when the client closes the stream first."""
        stall = self.config.stall_timeout
        try:  # a stream that sends nothing would hold its place among max_streams
            first = await asyncio.wait_for(context.read(), stall)
        except asyncio.TimeoutError:
            await _abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no Setup within stall_timeout={stall:g}s of opening the stream",
            )
        except DecodeError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed StreamRequest: {exc}")
        if first is grpc.aio.EOF:
            return None
        if first.WhichOneof("kind") != "setup":
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message of a stream must be a Setup")
        return first.setup


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """Ends the call with ``code`` and ``details``: grpc's abort raises, and this says so to the type checker."""
    await context.abort(code, details)
    raise AssertionError("ServicerContext.abort returned")
