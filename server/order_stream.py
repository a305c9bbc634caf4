"""One client's order stream, after its Setup: orders in, chunks out, in order.

A reader task takes the client's messages and checks each order; a starter task cuts the
orders, in turn, into chunks of ``protos.limits.samples_per_chunk`` samples, takes a slot
for each (within the stream's fair share, after the rate limit) and starts rendering it;
the stream's own loop writes the chunks in the order they were started, each once its
rendering is done. Invariants:
* Every chunk's slot goes back exactly once, and only when no worker writes into it any
  more: after its chunk is written, or when the stream ends (sharing.SharedRenders.give_when_done).
* At most ``max_inflight_orders`` orders are in flight (received, last chunk not yet written);
  the server's ``remoteloader_queued_orders`` counts them over all streams.
* A Cancel for an order in flight stops it: its chunks not yet started are not rendered,
  those started are not written (their slots go back as usual); a Cancel for any other id
  is ignored. The reader reads on while orders wait for slots, so a Cancel acts at once.
* Whatever ends the stream (the client's EOF, a bad message, draining, a stall, a server
  bug) ends it with a status that says why; the reader never hangs it.
* Shared memory (Setup.shared_memory, a same-host client that maps the arena: how its chunks
  go out is server.delivery's): a chunk goes out as its header alone, with ChunkHeader.shared
  saying where its payload lies, and its slot is lent to the client (local_socket.Loans)
  until a Release names its ticket, or the stream ends; a cancelled order's chunks already
  sent are no exception. A Release of a
  ticket the stream has not lent ends it (INVALID_ARGUMENT); a client that keeps a slot
  unreleased is ended as one that does not read is.
* A chunk that another stream renders too (the same key: server.sharing) is rendered once
  and written from that one slot to each of them; it costs this stream its place in the
  slots' fair share, and no decode; nor ``--max-rate`` where it can be joined when its turn
  comes (one evicted meanwhile is rendered unpaid, one started meanwhile joined paid for:
  the rate is a cap on renders, approximately).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError

from remoteloader.protos import codec, limits, loader_pb2
from remoteloader.server.catalog import Catalog
from remoteloader.server.chunk_payload import chunk_payload
from remoteloader.server.config import ServerConfig
from remoteloader.server.delivery import PayloadDelivery, SharedDelivery
from remoteloader.server.fair_queue import Job
from remoteloader.server.fetching import Fetcher
from remoteloader.server.metrics import Metrics
from remoteloader.server.order_samples import OrderError, Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.rate_limit import RateLimiter
from remoteloader.server.render import Renderer
from remoteloader.server.sharing import ChunkKey, SharedRenders
from remoteloader.server.slots import Slots
from remoteloader.server.stalls import Stalled, Stalls
from remoteloader.server.targets import MASK
from remoteloader.server.worker_pool import Rendered

log = logging.getLogger(__name__)


class OutChunk(NamedTuple):
    """A chunk as the Stream writes it: header and pixels (a view into its slot), never copied."""

    header: loader_pb2.ChunkHeader
    pixels: memoryview | list[memoryview]  # or its samples' encoded parts, in order (Setup.wire)


def serialize_chunk(chunk: OutChunk) -> bytes:
    """The Stream's response serializer."""
    return codec.encode_chunk(chunk.header, chunk.pixels)


class _Pending(NamedTuple):
    """A chunk being rendered into its slot, to be written in turn."""

    order: loader_pb2.Order
    samples: Samples  # the whole order's
    start: int  # the chunk's first sample, a position in the order
    size: int  # its samples
    slot: int
    future: asyncio.Future[Rendered]
    received: float  # time.monotonic() when its order was received
    joined: bool  # rendered for another stream too, which started it


class _End(NamedTuple):
    """Ends the stream with this status."""

    code: grpc.StatusCode
    details: str


class _Cut(NamedTuple):
    """An order cancelled before all its chunks were started: it ends here."""

    order: loader_pb2.Order
    received: float


class StreamRooms(NamedTuple):
    """What every stream of a server works with: made once, by the service."""

    config: ServerConfig  # chunk_bytes, max_order_samples, max_inflight_orders
    catalog: Catalog  # the server's shards
    fetcher: Fetcher  # brings chunks' object-store bytes here before they render
    renderer: Renderer  # starts rendering chunks
    slots: Slots  # the shared slots
    renders: SharedRenders  # the renderings streams share, by chunk
    stalls: Stalls  # the stall rules
    limiter: RateLimiter | None  # the server-wide rate limit, if any
    metrics: Metrics  # the server's counters
    draining: asyncio.Event  # set when the server drains: streams take no more orders


class OrderStream:
    """Serves one stream's orders; ``run`` returns when the client is done, or ends the stream.

    Args:
        context: The Stream call's context.
        peer: The client, as logged.
        spec: The stream's checked pipeline.
        rooms: What the server's streams work with.
        job: Whom the stream's decode is for: its job's name ("#n" for stream n, which names none);
            what it weighs is the job registry's (server.jobs, which the slots open it in).
        job_label: The job as the metrics name it (Metrics.job_label).
        exclusive: Never share a rendering (Setup.exclusive).
        shared: Whether the client maps the arena (Setup.shared_memory): its chunks' slots are
            lent to it (local_socket.Loans).
    """

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        peer: str,
        spec: PipelineSpec,
        rooms: StreamRooms,
        *,
        job: str,
        job_label: str,
        exclusive: bool,
        shared: bool = False,
    ):
        self._context = context
        self._peer = peer
        self._spec = spec
        self._config = rooms.config
        self._catalog = rooms.catalog
        self._fetcher = rooms.fetcher
        self._renderer = rooms.renderer
        self._slots = rooms.slots
        self._renders = rooms.renders
        self._stalls = rooms.stalls
        self._exclusive = exclusive
        metrics = rooms.metrics
        self._job_images = metrics.job_images.labels(job_label)  # (the job's counters, looked up once)
        self._job_rendered = metrics.job_rendered.labels(job_label)
        self._limiter = rooms.limiter
        self._metrics = metrics
        self._draining = rooms.draining
        self._queue: asyncio.Queue[_Pending | _Cut | _End | None] = asyncio.Queue()  # None: the client is done
        # Orders received and checked, to be started in turn (with when each came), then an
        # _End or None: what the reader makes of the client's messages, in their order.
        self._orders: asyncio.Queue[tuple[loader_pb2.Order, Samples, float] | _End | None] = asyncio.Queue()
        self._slot_counts = self._slots.open(job)
        self._job = Job(job)
        self._delivery = (
            SharedDelivery(self._stalls, self._renders, self._slot_counts, self._slots.arena)
            if shared
            else PayloadDelivery()
        )
        self._live: set[int] = set()  # ids of the orders received whose last chunk is not written yet
        self._cancelled: set[int] = set()  # of those, the ones the client no longer wants

    async def run(self) -> None:
        """Writes the chunks as they are rendered until the client is done or the stream ends."""
        context = self._context
        reader = asyncio.create_task(self._read_orders())
        starter = asyncio.create_task(self._start_orders())
        try:
            while True:
                item = await self._delivery.next(self._queue)
                if item is None:
                    return
                if isinstance(item, _End):
                    await self._delivery.before_end(item)  # (draining, shared: the copies under way finish)
                    await context.abort(item.code, item.details)
                    return
                if isinstance(item, _Cut):
                    self._finish(item.order, item.received)
                    continue
                await self._write_chunk(item)
        except Stalled as stalled:
            log.warning("stream from %s: %s; ending it", self._peer, stalled)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the client {stalled}")
        finally:
            reader.cancel()
            starter.cancel()
            self._metrics.queued_orders.dec(len(self._live))  # the orders the stream ends with
            self._live.clear()
            # Slots still being written by a worker go back only when the worker is done.
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if isinstance(item, _Pending):
                    self._renders.give_when_done(self._slot_counts, item.slot, item.future)
            self._delivery.end()
            self._slots.close(self._slot_counts)

    async def _read_orders(self) -> None:
        drain = asyncio.ensure_future(self._draining.wait())
        read = None
        drained = False
        try:
            while True:
                if read is None:
                    read = asyncio.ensure_future(self._context.read())
                done, _ = await asyncio.wait({read} if drained else {read, drain}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done:
                    self._orders.put_nowait(
                        _End(
                            grpc.StatusCode.UNAVAILABLE,
                            "server is draining (SIGTERM or SIGINT); send unfinished orders elsewhere",
                        )
                    )
                    if not self._delivery.reads_releases:
                        return
                    drained = True  # shared memory: read on, for the client's Releases
                    continue
                request, read = read.result(), None
                if request is grpc.aio.EOF:
                    if not drained:
                        self._orders.put_nowait(None)
                    return
                kind = request.WhichOneof("kind")
                if kind == "cancel":
                    if request.cancel.order_id in self._live:
                        self._cancelled.add(request.cancel.order_id)
                    continue
                if kind == "release":
                    error = self._release(request.release)
                    if error:
                        self._fail(error)
                        return
                    continue
                if drained:  # (the stream ends UNAVAILABLE once its orders in flight are written)
                    continue
                checked = self._check(request)
                if isinstance(checked, _End):
                    self._fail(checked)
                    return
                self._metrics.queued_orders.inc()
                self._live.add(request.order.order_id)
                self._orders.put_nowait((request.order, checked, time.monotonic()))
                # Its samples' bytes start coming now, where they are in an object store.
                self._fetcher.prefetch(self._spec, checked)
        except asyncio.CancelledError:
            pass
        except DecodeError as exc:  # a message that is not a StreamRequest
            self._fail(_End(grpc.StatusCode.INVALID_ARGUMENT, f"malformed StreamRequest: {exc}"))
        except Exception as exc:  # surface server bugs as a stream error, never a hang
            log.exception("stream reader failed")
            self._fail(_End(grpc.StatusCode.INTERNAL, f"server error: {type(exc).__name__}: {exc}"))
        finally:
            drain.cancel()
            if read is not None:
                read.cancel()

    def _fail(self, end: _End) -> None:
        """Ends the stream for what the client sent (or a server bug): after the chunks already
        started; with shared memory at once, as the client's Releases are no longer read, so
        chunks that wait for its slots would never come."""
        self._orders.put_nowait(end)
        self._delivery.fail(end, self._queue)

    def _release(self, release: loader_pb2.Release) -> _End | None:
        """Gives back the slots the client has copied out of; why the stream must end, or None."""
        details = self._delivery.release(release)
        return _End(grpc.StatusCode.INVALID_ARGUMENT, details) if details else None

    def _check(self, request: loader_pb2.StreamRequest) -> Samples | _End:
        """The samples an order asks for, or why it cannot be served."""
        c = self._config
        if request.WhichOneof("kind") != "order":
            return _End(grpc.StatusCode.INVALID_ARGUMENT, "only the first message of a stream may be a Setup")
        order = request.order
        n = len(order.indices)
        if not 0 < n <= c.max_order_samples:
            return _End(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"order {order.order_id} has {n} samples; expected 1..{c.max_order_samples} (max_order_samples)",
            )
        try:
            samples = Samples.of_order(order, self._catalog)
        except OrderError as exc:
            return _End(grpc.StatusCode.INVALID_ARGUMENT, f"order {order.order_id}: {exc}")
        if order.order_id in self._live:  # (its chunks, its cancel, its end could not be told apart)
            return _End(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"order {order.order_id} is already in flight on this stream; order ids must differ",
            )
        if len(self._live) >= c.max_inflight_orders:
            return _End(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"more than max_inflight_orders={c.max_inflight_orders} orders in flight on one stream",
            )
        return samples

    async def _start_orders(self) -> None:
        """Starts the orders the reader passes on, in turn; passes on the end of the stream."""
        spec = self._spec
        per_chunk = limits.samples_per_chunk(
            self._delivery.chunk_bytes(self._config),
            limits.sample_bytes(spec.height, spec.width, MASK in spec.fields),
            bool(spec.fields),
        )
        try:
            while True:
                item = await self._orders.get()
                if item is None or isinstance(item, _End):
                    self._queue.put_nowait(item)
                    return
                await self._start_order(*item, per_chunk)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # surface server bugs as a stream error, never a hang
            log.exception("stream starter failed")
            self._queue.put_nowait(_End(grpc.StatusCode.INTERNAL, f"server error: {type(exc).__name__}: {exc}"))

    async def _start_order(self, order: loader_pb2.Order, samples: Samples, received: float, per_chunk: int) -> None:
        """Starts rendering an order's ``samples`` chunk by chunk, each into a slot of its own,
        and queues the chunks; stops where the client cancelled it."""
        seeds = samples.seeds(order.seed, order.epoch)
        for start in range(0, len(samples), per_chunk):
            if order.order_id in self._cancelled:
                self._queue.put_nowait(_Cut(order, received))
                return
            count = min(per_chunk, len(samples) - start)
            part = samples[start : start + count]
            shareable = not (self._exclusive or part.synthetic)
            key = ChunkKey.of(self._spec, part, order.seed, order.epoch) if shareable else None
            if self._limiter is not None and not self._renders.has(key):
                await self._limiter.take(count)

            def render(slot: int, part: Samples = part, chunk_seeds: list[int] = seeds[start : start + count]):
                # (its object-store bytes first, where it has any: server.fetching)
                return self._fetcher.then_render(
                    self._spec,
                    part,
                    lambda located, failures: self._renderer.render(
                        self._spec, part, chunk_seeds, slot, self._job, located, failures
                    ),
                )

            slot, future, joined = await self._renders.start(self._slot_counts, key, render)
            if not joined:
                self._metrics.images_rendered.inc(count)
                self._job_rendered.inc(count)
            self._queue.put_nowait(_Pending(order, samples, start, count, slot, future, received, joined))

    async def _write_chunk(self, item: _Pending) -> None:
        lent = False
        try:
            # Shielded: a cancelled stream must not cancel the chunk's future, which completes
            # only when every worker task is done with the slot.
            rendered = await asyncio.shield(item.future)
            if item.order.order_id not in self._cancelled:  # (cancelled: another server sent it first)
                ticket = self._delivery.lend(item.slot)  # (shared memory: lent before the write)
                lent = ticket is not None
                await self._send(item, rendered, ticket)
        finally:
            if not lent:  # (a lent slot comes back by its Release, or when the stream ends)
                self._renders.give_when_done(self._slot_counts, item.slot, item.future)
        if item.start + item.size == len(item.samples):
            self._finish(item.order, item.received)

    def _finish(self, order: loader_pb2.Order, received: float) -> None:
        """The order's last chunk is written (or it was cancelled): it is no longer in flight."""
        self._live.discard(order.order_id)
        self._cancelled.discard(order.order_id)
        self._metrics.queued_orders.dec()
        self._metrics.orders.inc()
        self._metrics.order_latency.observe(time.monotonic() - received)

    async def _send(self, item: _Pending, rendered: Rendered, ticket: int | None) -> None:
        """Writes a rendered chunk: its pixels in the message, or (``ticket``: shared memory, its
        slot lent under that ticket) where they lie in the arena."""
        spec = self._spec
        errors, targets = rendered
        part = item.samples[item.start : item.start + item.size]
        header = loader_pb2.ChunkHeader(
            order_id=item.order.order_id,
            start=item.start,
            count=item.size,
            order_size=len(item.samples),
            height=spec.height,
            width=spec.width,
            channels=limits.CHANNELS,
            labels=part.labels(),
            errors=[
                loader_pb2.SampleError(
                    position=item.start + pos,
                    index=int(part.indices[pos]),
                    key=part.key(pos),
                    reason=reason,
                )
                for pos, reason in errors
            ],
            workers_busy=self._renderer.pool.busy_share(),
            joined=item.joined,
        )
        for record in targets:
            header.targets.add().MergeFromString(record)
        # Raw, or each sample as its worker encoded it (Setup.wire): what travels is counted.
        pixels, sizes = chunk_payload(spec, part, self._slots.arena, item.slot, item.size, errors)
        header.encoded_sizes.extend(sizes)
        nbytes = sum(sizes) if sizes else len(pixels)
        pixels = self._delivery.place(header, item.slot, nbytes, ticket, pixels)
        chunk = OutChunk(header, pixels)
        await self._stalls.send(self._context.write(chunk), self._slot_counts)
        m = self._metrics
        m.images.inc(item.size)
        self._job_images.inc(item.size)
        if item.joined:
            m.images_joined.inc(item.size)
        m.bytes.inc(nbytes)
        if errors:
            m.decode_errors.inc(len(errors))
