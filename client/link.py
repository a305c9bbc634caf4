"""One loader server as seen from the client: channels, Describe, and the order stream.

A Link lives on the client's I/O event loop. It owns a control channel (Describe,
GetKeys) and a data channel whose receive limit is set from the batch shape, sends
orders through a writer task and hands every received chunk to its engine. Any stream
failure is reported once to the engine, which decides between failover and an error.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from remoteloader.client.security import TLSConfig
from remoteloader.protos import codec, loader_pb2, loader_pb2_grpc

_STREAM = "/remoteloader.v1.Loader/Stream"
MiB = 1 << 20
RETRY_DELAY = 0.1  # first reconnect attempt after a failure; doubles up to 2 s

# Status codes that mean the request itself is wrong: retrying elsewhere cannot help.
# (RESOURCE_EXHAUSTED is not among them: "too many open streams" passes when others close.)
FATAL_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
})


def channel_options(max_receive: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_send_message_length", 16 * MiB),
        # Notice a dead peer within seconds, not at the next TCP timeout. (Adding
        # keepalive_permit_without_calls with max_pings_without_data=0 made the server
        # spend 4x the CPU per GB and halved throughput: measured, leave them out.)
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


class Link:
    """A connection to one loader server and its order stream."""

    def __init__(self, address: str, engine, connect_timeout: float, max_inflight: int,
                 tls: TLSConfig | None = None, metadata: tuple = ()):
        self.address = address
        self.tls = tls
        self.metadata = metadata
        self.engine = engine
        self.connect_timeout = connect_timeout
        self.wanted_inflight = max_inflight
        self.max_inflight = max_inflight
        self.describe: loader_pb2.DescribeResponse | None = None
        self.shard_ids: frozenset[str] = frozenset()
        self.state = "new"  # new | up | down | closed
        self.inflight: dict[int, object] = {}
        self.orders_sent = 0
        self.samples_received = 0
        self.bytes_received = 0
        self.failures = 0
        self.reconnects = 0
        self.down_since: float | None = None
        self.retry_delay = RETRY_DELAY  # the engine's first wait before reconnecting (see _fail)
        self.last_error = ""
        self.gave_up = ""  # why the engine stopped trying this server, if it did
        self.last_progress = 0.0  # its last chunk, or when it was given work while idle
        self._up_since = 0.0
        self.outstanding = 0  # samples sent and not yet received
        self.rate = 0.0  # samples/s while busy, a moving average (0: not measured yet)
        self._control: grpc.aio.Channel | None = None
        self._data: grpc.aio.Channel | None = None
        self._call = None
        self._tasks: list[asyncio.Task] = []
        self._outbox: asyncio.Queue | None = None
        self._healthy = False

    @property
    def credits(self) -> int:
        return self.max_inflight - len(self.inflight) if self.state == "up" else 0

    def _channel(self, max_receive: int) -> grpc.aio.Channel:
        options = channel_options(max_receive)
        if self.tls is None:
            return grpc.aio.insecure_channel(self.address, options=options)
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.aio.secure_channel(self.address, self.tls.credentials(), options=options)

    async def fetch_describe(self, timeout: float | None = None) -> loader_pb2.DescribeResponse:
        """Connects the control channel and asks what the server holds (bounded in time)."""
        timeout = self.connect_timeout if timeout is None else timeout
        if self._control is None:
            self._control = self._channel(16 * MiB)
        stub = loader_pb2_grpc.LoaderStub(self._control)
        try:
            describe = await stub.Describe(loader_pb2.DescribeRequest(), timeout=timeout,
                                           wait_for_ready=True, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                hint = " (RemoteLoader(token=...) sends it)" if exc.code() == grpc.StatusCode.UNAUTHENTICATED else ""
                raise PermissionError(f"loader server {self.address} refused this client: {exc.code().name}: "
                                      f"{exc.details()}{hint}") from None
            raise ConnectionError(f"loader server {self.address} did not answer within {timeout:g}s "
                                  f"(down, unreachable, or a TLS/plaintext mismatch): {exc.code().name}: "
                                  f"{exc.details()}") from None
        self.describe = describe
        self.shard_ids = frozenset(s.id for s in describe.shards)
        self.max_inflight = max(1, min(self.wanted_inflight, describe.max_inflight_orders))
        return describe

    async def get_keys(self, shard_id: str, start: int, count: int) -> list[str]:
        stub = loader_pb2_grpc.LoaderStub(self._control)
        reply = await stub.GetKeys(loader_pb2.GetKeysRequest(shard_id=shard_id, start=start, count=count),
                                   timeout=self.connect_timeout, metadata=self.metadata)
        return list(reply.keys)

    async def open_stream(self, setup: loader_pb2.Setup) -> None:
        """Opens the order stream (after fetch_describe) and starts the reader and writer."""
        sample_bytes = setup.height * setup.width * 3
        limit = max(self.describe.chunk_bytes, sample_bytes) + MiB
        if self._data is None:
            self._data = self._channel(limit)
        method = self._data.stream_stream(_STREAM, request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                          response_deserializer=codec.decode_chunk)
        self._call = method(metadata=self.metadata)
        self._outbox = asyncio.Queue()
        self._outbox.put_nowait(loader_pb2.StreamRequest(setup=setup))
        self.state = "up"
        self.gave_up = ""
        self._healthy = False  # until a chunk arrives on this stream
        self._up_since = self.last_progress = time.monotonic()
        call = self._call
        self._tasks = [asyncio.ensure_future(self._write(call)), asyncio.ensure_future(self._read(call))]

    def record(self, samples: int) -> None:
        """Updates the rate from a chunk's arrival (the gap since the previous one, while busy)."""
        now = time.monotonic()
        gap = now - self.last_progress
        self.last_progress = now
        if 0 < gap < 5.0:  # a longer gap means the server was idle, not slow
            weight = min(1.0, gap)  # about a one-second memory
            self.rate = (1 - weight) * self.rate + weight * (samples / gap) if self.rate else samples / gap

    def send(self, order: loader_pb2.Order) -> None:
        if len(self.inflight) == 1:  # it was idle: the next gap and the progress clock start now
            self.last_progress = time.monotonic()
        self.orders_sent += 1
        self._outbox.put_nowait(loader_pb2.StreamRequest(order=order))

    async def _write(self, call) -> None:
        try:
            while True:
                request = await self._outbox.get()
                await call.write(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The reader sees the same failure with the server's status: let it report, and
            # only report here if it does not within a moment.
            await asyncio.sleep(1.0)
            if call is self._call:
                self._fail(exc)

    async def _read(self, call) -> None:
        try:
            async for chunk in call:
                if call is not self._call:
                    return
                if not self._healthy:
                    self._healthy = True
                    self.down_since = None
                self.engine.on_chunk(self, chunk)  # which calls record(): progress and rate
            raise ConnectionError("the server closed the stream")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if call is self._call:
                self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if self.state != "up":
            return
        self.state = "down"
        self.failures += 1
        # A stream that failed again soon, before delivering anything, keeps the first
        # failure's time and the reconnect back-off reached, so a server that accepts
        # connections but fails (or refuses) every stream is retried ever more slowly and
        # still runs out of reconnect_timeout; one that worked, or lasted, starts afresh.
        if self.down_since is None or self._healthy or time.monotonic() - self._up_since > 10.0:
            self.down_afresh()
        self.last_error = describe_error(exc)
        self._stop_stream()
        self.engine.on_link_down(self, exc)

    def _stop_stream(self) -> None:
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks = []
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def down_afresh(self) -> None:
        """Starts a new spell of downtime: reconnect_timeout and the back-off from now."""
        self.state = "down"
        self.down_since = time.monotonic()
        self.retry_delay = RETRY_DELAY

    async def reset_channels(self) -> None:
        for channel in (self._control, self._data):
            if channel is not None:
                await channel.close(grace=None)
        self._control = self._data = None

    async def close(self) -> None:
        self.state = "closed"
        self._stop_stream()
        await self.reset_channels()


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def is_fatal(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in FATAL_CODES
