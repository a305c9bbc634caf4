r"""One loader server as seen from the client: its channels, its order stream, and its health.

A Link lives on the client's I/O event loop. It owns a control channel (Describe,
GetKeys: ``control_channel.py``) and a data channel whose receive limit is set from the batch shape, sends
orders through a writer task and hands every received chunk to its engine.

It also owns its connection's state machine, with the reconnect back-off and the orders
in flight, and tells its engine (``LinkEvents``) what happened; the engine decides where
orders go. The states::

    NEW --open_stream--> UP --fail--> DOWN --reconnected--> UP
                                       |  \--refused (a fatal status)--> DEAD
                                       \--reconnect_timeout passed----> DEAD
    DOWN or DEAD --revive (a new epoch)--> DOWN;   any --close--> CLOSED

A stream that fails again before delivering anything (soon, or stuck: holding orders it
never answered for progress_timeout) keeps the first failure's time and the back-off reached,
so a server that accepts connections but fails, refuses or never serves every stream is
retried ever more slowly and still runs out of reconnect_timeout: a server that takes orders
and never delivers is given up at its first stall after reconnect_timeout.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from remoteloader.client import same_host
from remoteloader.client.control_channel import ControlChannel, open_channel
from remoteloader.client.option_groups import ConnectionOptions, SecurityOptions
from remoteloader.protos import SERVICE, codec, limits, loader_pb2

log = logging.getLogger("remoteloader.client")

_STREAM = f"/{SERVICE}/Stream"
RETRY_DELAY = 0.1  # first reconnect attempt after a failure; doubles up to MAX_RETRY_DELAY
MAX_RETRY_DELAY = 2.0
HEALTHY_AFTER = 10.0  # seconds a stream must last to count as working without delivering anything
STILL_DOWN_EVERY = 10.0  # seconds between "still down" warnings while a server is retried
DROPPED = 256  # cancelled orders whose chunks still on the way a link recognizes (and drops)

# Status codes that mean the request itself is wrong: retrying elsewhere cannot help.
# (RESOURCE_EXHAUSTED is not among them: "too many open streams" passes when others close.)
FATAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


class LinkState(enum.Enum):
    """Where a link's connection stands (its ``value`` is what ``stats()`` reports)."""

    NEW = "new"  # described, no order stream yet
    UP = "up"  # streaming
    DOWN = "down"  # failed; reconnecting with back-off until reconnect_timeout
    DEAD = "dead"  # refused this client, or unreachable past reconnect_timeout (until revived)
    CLOSED = "closed"


class Work(Protocol):
    """What a link needs of an order it carries."""

    order_id: int
    cancelled: bool  # the engine no longer wants it: a failure does not hand it back

    @property
    def samples(self) -> int: ...


OrderT = TypeVar("OrderT", bound=Work)


@dataclass
class Arrival(Generic[OrderT]):
    """A chunk as its link resolved it before the engine sees it: counted, its bytes (in the
    server's memory for a same-host chunk: ``payload`` reads them there), the order in flight it
    belongs to (None: none; the engine's check refuses it), and ``release`` to give a shared
    chunk's memory back once it is copied out. Chunks of an order cancelled on this stream never
    become one (the link drops them)."""

    header: loader_pb2.ChunkHeader
    payload: memoryview
    order: OrderT | None
    link: Link[OrderT] | None = None  # (None: nothing to release)
    shared: loader_pb2.SharedPayload | None = None

    def release(self) -> bool:
        """Its memory goes back to the server, if it is a shared chunk; whether the copy made of
        it is whole (the server did not reuse the slot meanwhile)."""
        if self.shared is None or self.link is None:
            return True
        return self.link.release(self.shared)


class LinkEvents(Protocol):
    """What a link tells its engine; every call comes on the I/O loop."""

    def on_chunk(self, link: Link[Any], arrival: Arrival[Any]) -> None:
        """A chunk arrived on the stream, resolved (the engine checks it, places it, releases it
        and calls ``complete`` when its order is whole)."""

    def on_link_down(self, link: Link[Any], orders: list[Any], exc: BaseException) -> None:
        """The stream failed; ``orders`` were in flight and not cancelled, and are the engine's again."""

    def on_link_up(self, link: Link[Any]) -> None:
        """The link reconnected and has credits again."""

    def on_link_lost(self, link: Link[Any]) -> None:
        """The link stopped reconnecting (DEAD, or closed meanwhile). Its orders were handed back
        already (``on_link_down``); the engine checks whether pending work is now left without
        an owner that is up or coming back."""


class Link(Generic[OrderT]):
    """A connection to one loader server: channels, order stream, state, back-off, orders in flight.

    Args:
        address: ``host:port`` of the server.
        events: Its engine, told of chunks, failures and reconnections.
        connection: Timeouts, credits, the wire (RemoteLoader's ConnectionOptions).
        security: Credentials (RemoteLoader's SecurityOptions).

    Others read its counters and ``state``; only its own methods change them.
    """

    def __init__(self, address: str, events: LinkEvents, connection: ConnectionOptions, security: SecurityOptions):
        self.address = address
        self.connection = connection
        self.security = security
        self._events = events
        self.max_inflight = connection.max_inflight  # lowered to what the server allows by fetch_describe
        self.describe: loader_pb2.DescribeResponse | None = None
        self.state = LinkState.NEW
        self.orders_sent = 0
        self.samples_received = 0
        self.samples_shared = 0  # of those, samples the server decoded once for another stream too
        self.bytes_received = 0
        self.failures = 0
        self.reconnects = 0
        self.outstanding = 0  # samples sent and not yet received
        self.rate = 0.0  # samples/s while busy, a moving average (0: not measured yet)
        self.workers_busy = 0.0  # the server's decode workers' busy share, as it last said
        self.busy_samples = 0.0  # the sum of workers_busy over the samples received (averages over a span)
        self.last_error = ""
        self.gave_up = ""  # why it is DEAD, if it is
        self._inflight: dict[int, OrderT] = {}
        self._dropped: collections.deque[int] = collections.deque(maxlen=DROPPED)  # orders cancelled here
        self._down_since: float | None = None  # start of this spell of downtime (reconnect_timeout counts from it)
        self._retry_delay = RETRY_DELAY  # the next reconnect's first wait
        self._last_progress = 0.0  # its last chunk, or when it was given work while idle
        self._up_since = 0.0
        self._healthy = False  # the current stream has delivered a chunk
        self._stuck = False  # the last failure was a stream that held orders and sent nothing
        self._setup: loader_pb2.Setup | None = None
        self.shared: same_host.SharedChunks | None = None  # a same-host server's chunk memory, on this stream
        self.control = ControlChannel(address, connection, security)  # Describe, GetKeys
        self._data: grpc.aio.Channel | None = None
        self._call: Any = None
        self._tasks: list[asyncio.Task] = []
        self._outbox: asyncio.Queue[loader_pb2.StreamRequest] = asyncio.Queue()
        self._reconnector: asyncio.Task | None = None

    # ---- what the engine reads --------------------------------------------------------
    @property
    def credits(self) -> int:
        """Orders it may be sent now."""
        return self.max_inflight - len(self._inflight) if self.state is LinkState.UP else 0

    @property
    def hopeful(self) -> bool:
        """Up, or down and still reconnecting: its shards' work may wait for it."""
        return self.state is LinkState.UP or (self.state is LinkState.DOWN and self._reconnecting())

    def order(self, order_id: int) -> OrderT | None:
        """The order in flight with that id, if any."""
        return self._inflight.get(order_id)

    def orders(self) -> list[OrderT]:
        """The orders in flight."""
        return list(self._inflight.values())

    def counters(self) -> dict[str, int | float | str]:
        """Its counters and state, as ``stats()["servers"]`` reports them."""
        return {
            "orders": self.orders_sent,
            "samples": self.samples_received,
            "shared_samples": self.samples_shared,
            "bytes": self.bytes_received,
            "failures": self.failures,
            "reconnects": self.reconnects,
            "workers": self.describe.workers if self.describe is not None else 0,
            "shared_memory": self.shared is not None,
            "workers_busy": self.workers_busy,
            "busy_samples": self.busy_samples,
            "state": self.state.value,
        }

    # ---- control channel: ControlChannel's ----------------------------------------
    async def fetch_describe(
        self, timeout: float | None = None, refused: bool = False, starting: bool = False
    ) -> loader_pb2.DescribeResponse:
        """Asks what the server holds over the control channel (``ControlChannel.describe``: what
        ``refused`` and ``starting`` mean) and takes the answer (``adopt``)."""
        timeout = self.connection.connect_timeout if timeout is None else timeout
        describe = await self.control.describe(timeout, refused=refused, starting=starting)
        self.adopt(describe)
        return describe

    def adopt(self, describe: loader_pb2.DescribeResponse) -> None:
        """What the server said when it was described (here, or before this link was made: a
        loader describes each server once at start, ``thread_receiver.describe_servers``)."""
        self.describe = describe
        self.max_inflight = max(1, min(self.connection.max_inflight, describe.max_inflight_orders))

    async def get_keys(self, shard_id: str, start: int, count: int) -> list[str]:
        return await self.control.get_keys(shard_id, start, count)

    # ---- the order stream -------------------------------------------------------------
    async def open_stream(self, setup: loader_pb2.Setup) -> None:
        """Opens the order stream (after fetch_describe) and starts the reader and writer: UP."""
        assert self.describe is not None, "open_stream before fetch_describe"
        self._setup = setup
        await self._map_shared()
        if self.shared is not None:
            setup = loader_pb2.Setup()
            setup.CopyFrom(self._setup)
            setup.shared_memory = True
        limit = limits.max_message_bytes(self.describe.chunk_bytes, limits.sample_bytes(setup.height, setup.width))
        if self._data is None:
            self._data = open_channel(self.address, self.security.tls, limit)
        method = self._data.stream_stream(
            _STREAM,
            request_serializer=loader_pb2.StreamRequest.SerializeToString,
            response_deserializer=codec.decode_chunk,
        )
        self._call = call = method(metadata=self.security.metadata)
        self._outbox = asyncio.Queue()
        self._outbox.put_nowait(loader_pb2.StreamRequest(setup=setup))
        self.state = LinkState.UP
        self.gave_up = ""
        self._healthy = False  # until a chunk arrives on this stream
        self._up_since = self._last_progress = time.monotonic()
        self._tasks = [asyncio.ensure_future(self._write(call)), asyncio.ensure_future(self._read(call))]

    async def _map_shared(self) -> None:
        """Maps the server's chunk memory when it runs on this host and offers it (each new
        stream: the server may have restarted); else the stream carries the pixels."""
        self._unmap_shared()
        describe = self.describe
        if not (self.connection.reads_shared_memory and describe is not None and same_host.on_this_host(describe)):
            return
        try:
            self.shared = await asyncio.get_running_loop().run_in_executor(
                None, same_host.SharedChunks.open, describe.local_socket, self.security.token
            )
        except (OSError, ValueError) as exc:  # elsewhere after all (another container), or refused
            log.info(
                "loader server %s: its memory is not shared with this client (%s); reading over gRPC", self.address, exc
            )

    def _unmap_shared(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def _resolve(self, chunk: codec.DecodedChunk) -> Arrival[OrderT] | None:
        """The chunk counted and resolved for the engine (None: dropped here, or the link failed)."""
        header, payload = chunk
        shared = header.shared if header.HasField("shared") else None  # its payload in the server's memory
        if shared is not None:
            try:
                payload = self._shared_payload(shared)
            except ValueError as exc:
                self.fail(ConnectionError(f"bad shared chunk from {self.address} (order {header.order_id}): {exc}"))
                return None
        order = self._inflight.get(header.order_id)
        if order is None and header.order_id in self._dropped:  # already on the way when it was cancelled
            self.received(len(payload), header.count, header.workers_busy)
            if shared is not None:
                self.release(shared)
            return None
        self.received(len(payload), header.count, header.workers_busy, header.joined)
        return Arrival(header, payload, order, self, shared)

    def _shared_payload(self, shared: loader_pb2.SharedPayload) -> memoryview:
        """A chunk's bytes in the server's memory (ValueError: not in it, or its slot reused)."""
        if self.shared is None:
            raise ValueError("a shared chunk on a stream that did not ask for them")
        return self.shared.payload(shared)

    def release(self, shared: loader_pb2.SharedPayload) -> bool:
        """The chunk was copied out: its memory goes back to the server. Whether the copy is
        whole (the server did not reuse the slot meanwhile)."""
        assert self.shared is not None
        whole = self.shared.generation(shared) == shared.generation
        self._outbox.put_nowait(loader_pb2.StreamRequest(release=loader_pb2.Release(tickets=[shared.ticket])))
        return whole

    def send(self, order: OrderT, request: loader_pb2.Order) -> None:
        """Sends an order (the engine checked ``credits``); it is in flight until ``complete``."""
        self._inflight[order.order_id] = order
        self.outstanding += order.samples
        if len(self._inflight) == 1:  # it was idle: the next gap and the progress clock start now
            self._last_progress = time.monotonic()
        self.orders_sent += 1
        self._outbox.put_nowait(loader_pb2.StreamRequest(order=request))

    def received(self, nbytes: int, samples: int, workers_busy: float, joined: bool = False) -> None:
        """Counts a well-formed chunk (``joined``: its decode shared with another stream) and
        updates the rate from its arrival (the gap since the previous one, while busy) and the
        share of the server's workers it says are busy."""
        self.bytes_received += nbytes
        if joined:
            self.samples_shared += samples
        self.workers_busy = min(1.0, max(0.0, workers_busy))  # (a float from the wire: NaN reads as 0)
        self.busy_samples += self.workers_busy * samples
        now = time.monotonic()
        gap = now - self._last_progress
        self._last_progress = now
        if 0 < gap < 5.0:  # a longer gap means the server was idle, not slow
            weight = min(1.0, gap)  # about a one-second memory
            self.rate = (1 - weight) * self.rate + weight * (samples / gap) if self.rate else samples / gap

    def cancel(self, order: OrderT) -> None:
        """The order is no longer wanted (another server sent it first; the engine marked it
        cancelled). A server that takes Cancel messages is told to send no more of it, and the
        order leaves the orders in flight; chunks of it already on the way are dropped as they
        come (``dropped``). Another server sends all of it, and it stays in flight till then."""
        if not (self.describe is not None and self.describe.cancels and self.state is LinkState.UP):
            return
        if self._inflight.pop(order.order_id, None) is None:
            return
        self.outstanding -= order.samples
        self._outbox.put_nowait(loader_pb2.StreamRequest(cancel=loader_pb2.Cancel(order_id=order.order_id)))
        self._dropped.append(order.order_id)

    def complete(self, order: OrderT) -> None:
        """All of an order's samples arrived: it is no longer in flight."""
        del self._inflight[order.order_id]
        self.outstanding -= order.samples
        self.samples_received += order.samples

    def check_progress(self, timeout: float) -> None:
        """Fails the stream if it holds orders but sent nothing for ``timeout`` seconds (stuck)."""
        if self.state is LinkState.UP and self._inflight and time.monotonic() - self._last_progress > timeout:
            self.fail(
                TimeoutError(
                    f"no data for progress_timeout={timeout:g}s with {len(self._inflight)} order(s) in flight"
                ),
                stuck=True,
            )

    async def _write(self, call: Any) -> None:
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
                self.fail(exc)

    async def _read(self, call: Any) -> None:
        try:
            async for chunk in call:
                if call is not self._call:
                    return
                self._healthy = True
                arrival = self._resolve(chunk)
                if arrival is not None:
                    self._events.on_chunk(self, arrival)
            raise ConnectionError("the server closed the stream")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if call is self._call:
                self.fail(exc)

    # ---- failure and reconnection -----------------------------------------------------
    def fail(self, exc: BaseException, stuck: bool = False) -> None:
        """The stream failed (or the engine found it malformed, or ``stuck``: holding orders it
        sent nothing of): DOWN and reconnecting, or DEAD when the server refused this client;
        its unfinished orders go back to the engine."""
        if self.state is not LinkState.UP:
            return
        self.failures += 1
        worked = self._healthy or (not stuck and time.monotonic() - self._up_since > HEALTHY_AFTER)
        if self._down_since is None or worked:
            self._down_afresh()
        self._stuck = stuck
        self.state = LinkState.DOWN
        self.last_error = describe_error(exc)
        self._stop_stream()
        orders = [o for o in self._inflight.values() if not o.cancelled]
        self._inflight.clear()
        self.outstanding = 0
        if is_fatal(exc):  # the request itself is refused: retrying this server cannot help
            self.state = LinkState.DEAD
            self.gave_up = f"refused: {describe_error(exc)}"
        else:
            self._start_reconnecting()
        self._events.on_link_down(self, orders, exc)

    def retry_left(self) -> float:
        """Seconds this link is still retried for (0: not retrying)."""
        if self.state is not LinkState.DOWN or self._down_since is None:
            return 0.0
        return max(0.0, self._down_since + self.connection.reconnect_timeout - time.monotonic())

    def revive(self) -> None:
        """A link given up on (or refused) earlier gets another reconnect_timeout, from now."""
        if self.state is LinkState.DEAD or (self.state is LinkState.DOWN and not self._reconnecting()):
            self._down_afresh()
            self.state = LinkState.DOWN
            self._start_reconnecting()

    def _down_afresh(self) -> None:
        """Starts a new spell of downtime: reconnect_timeout and the back-off count from now."""
        self._down_since = time.monotonic()
        self._retry_delay = RETRY_DELAY

    def _reconnecting(self) -> bool:
        return self._reconnector is not None and not self._reconnector.done()

    def _start_reconnecting(self) -> None:
        if not self._reconnecting():
            self._reconnector = asyncio.ensure_future(self._reconnect())

    async def _reconnect(self) -> None:
        """Retries with back-off until the stream is open again or reconnect_timeout has passed."""
        # The back-off carries over when a server fails again before sending anything
        # (one that refuses each new stream, e.g. RESOURCE_EXHAUSTED): no tight retry loop.
        delay = self._retry_delay
        reconnect_timeout = self.connection.reconnect_timeout
        since = self._down_since or time.monotonic()
        deadline = since + reconnect_timeout
        report = since + STILL_DOWN_EVERY
        while time.monotonic() < deadline and self.state is LinkState.DOWN:
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, MAX_RETRY_DELAY)
            try:
                await self._reset_channels()
                timeout = max(0.5, min(self.connection.connect_timeout, deadline - time.monotonic()))
                await self.fetch_describe(timeout, refused=True)  # (refused: back off and try again)
                assert self._setup is not None, "a link goes down only after open_stream"
                await self.open_stream(self._setup)
            except Exception as exc:  # still down; try again until the deadline
                self.last_error = describe_error(exc)
                now = time.monotonic()
                if now >= report and now < deadline:
                    report = now + STILL_DOWN_EVERY
                    log.warning(
                        "loader server %s still down after %.0fs; retrying for %.0fs more (reconnect_timeout=%gs): %s",
                        self.address,
                        now - since,
                        deadline - now,
                        reconnect_timeout,
                        self.last_error,
                    )
                continue
            self.reconnects += 1
            self._retry_delay = delay  # the next failure's first wait, unless this stream works
            # Measured anew: what it delivered before it failed (another process, perhaps, whose
            # first chunks paid its warm-up) says little now, and a server measured slow gets no
            # work while faster replicas keep up, so it would never be measured again.
            self.rate = 0.0
            log.info("loader server %s is back", self.address)
            self._events.on_link_up(self)
            return
        if self.state is LinkState.DOWN:
            self.state = LinkState.DEAD
            if self._stuck:
                self.gave_up = (
                    f"took orders but delivered nothing, again after reconnecting, for more than "
                    f"reconnect_timeout={reconnect_timeout:g}s ({self.last_error}): its decode workers may be stuck"
                )
            else:
                self.gave_up = f"unreachable for more than reconnect_timeout={reconnect_timeout:g}s ({self.last_error})"
        self._reconnector = None  # no longer hopeful: the engine checks what that strands
        self._events.on_link_lost(self)

    def _stop_stream(self) -> None:
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks = []
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._unmap_shared()  # a dead server's memory must not live on in this process

    async def _reset_channels(self) -> None:
        await self.control.close()
        if self._data is not None:
            await self._data.close(grace=None)
        self._data = None

    async def close(self) -> None:
        """Stops reconnecting, the stream and the channels: CLOSED."""
        self.state = LinkState.CLOSED
        if self._reconnector is not None and self._reconnector is not asyncio.current_task():
            self._reconnector.cancel()
        self._reconnector = None
        self._stop_stream()
        await self._reset_channels()


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def is_fatal(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in FATAL_CODES
