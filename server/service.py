"""The gRPC service: Describe, GetKeys and the order/chunk Stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import time
from typing import NamedTuple

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from remoteloader.protos import codec, loader_pb2
from remoteloader.server.catalog import Shard, SyntheticShard
from remoteloader.server.config import ServerConfig
from remoteloader.server.metrics import Metrics
from remoteloader.server.pipelines import PRESETS, Pipeline, PipelineError, PipelineSpec
from remoteloader.server.workers import Arena, SampleCache, Task, WorkerPool

log = logging.getLogger(__name__)

VERSION = "0.1.0"
SERVICE = "remoteloader.v1.Loader"
MAX_KEYS_PER_CALL = 10_000
TASK_SAMPLES = 8  # fewest samples per worker task
MAX_TASK_SAMPLES = 32  # most: a task message (paths included) stays well under the 64 KiB a pipe holds
# A stream whose client leaves a chunk unread this long while another stream waits for a
# slot is ended (its client reconnects and re-sends its orders): a client that does not
# read, or reads a chunk a minute, cannot keep the slots it took. A reading client's
# writes wait milliseconds; stall_timeout bounds the uncontended case.
CONTENDED_STALL = 10.0
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


class OutChunk(NamedTuple):
    header: loader_pb2.ChunkHeader
    pixels: memoryview


def serialize_chunk(chunk: OutChunk) -> bytes:
    return codec.encode_chunk(chunk.header, chunk.pixels)


def sample_seeds(seed: int, epoch: int, shard_key: int, indices: np.ndarray) -> list[int]:
    """64-bit per-sample seeds from (seed, epoch, shard, index): splitmix64 over a mix."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(epoch) * np.uint64(0xBF58476D1CE4E5B9)
        x = indices.astype(np.uint64) * np.uint64(0x94D049BB133111EB) ^ x ^ np.uint64(shard_key)
        for _ in range(2):
            x = x + np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
    return [int(v) for v in x]


class LoaderService:
    """Serves the shards of one server through a worker pool."""

    def __init__(self, config: ServerConfig, shards: list[Shard], pool: WorkerPool | None, arena: Arena,
                 cache: SampleCache | None = None):
        self.config = config
        self.cache = cache
        self.limiter = RateLimiter(config.max_rate) if config.max_rate else None
        self.shards = {s.id: s for s in shards}
        # Samples that have decoded whole without error: only these may have just their crop's
        # region decoded, which cannot see damage outside it (decode.decode_crop). A byte per
        # sample, in pages touched only as samples are marked.
        self._decoded = {s.id: np.zeros(len(s), np.bool_) for s in shards}
        self._shard_keys = {s.id: int(hashlib.sha256(s.id.encode()).hexdigest()[:16], 16) for s in shards}
        self.pool = pool
        self.arena = arena
        self._pipelines: dict[PipelineSpec, Pipeline] = {}
        self._draining = asyncio.Event()
        self._slot_freed = asyncio.Condition()
        self._slot_waiters = 0  # streams waiting in _take_slot
        # Pipelines are built and tried off the event loop, once per spec however many Setups
        # ask at once. Custom ones one at a time: one that is slow (a huge blur kernel) holds
        # up only other custom Setups, and one whose clients all left before it ran is dropped.
        self._preset_checks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="preset-check")
        self._custom_checks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pipeline-check")
        self._checks: dict[PipelineSpec, _Check] = {}
        self.metrics = Metrics()
        if pool is not None:
            self.metrics.queue_depth.set_function(lambda: pool.outstanding)
        self._streams_by_client: dict[str, int] = {}

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Describe": grpc.unary_unary_rpc_method_handler(
                self.Describe, request_deserializer=loader_pb2.DescribeRequest.FromString,
                response_serializer=loader_pb2.DescribeResponse.SerializeToString),
            "GetKeys": grpc.unary_unary_rpc_method_handler(
                self.GetKeys, request_deserializer=loader_pb2.GetKeysRequest.FromString,
                response_serializer=loader_pb2.GetKeysResponse.SerializeToString),
            "Stream": grpc.stream_stream_rpc_method_handler(
                self.Stream, request_deserializer=loader_pb2.StreamRequest.FromString,
                response_serializer=serialize_chunk),
        })

    def drain(self) -> None:
        """Stops taking new orders; streams finish what they hold, then end UNAVAILABLE."""
        self._draining.set()

    async def Describe(self, request, context) -> loader_pb2.DescribeResponse:
        c = self.config
        return loader_pb2.DescribeResponse(
            version=VERSION,
            shards=[loader_pb2.Shard(id=s.id, name=s.name, num_samples=len(s), class_names=s.class_names)
                    for s in self.shards.values()],
            pipelines=list(PRESETS), custom_pipelines=c.allow_custom_pipelines,
            min_image_size=c.min_image_size, max_image_size=c.max_image_size,
            max_order_samples=c.max_order_samples, max_inflight_orders=c.max_inflight_orders,
            chunk_bytes=c.chunk_bytes)

    async def GetKeys(self, request, context) -> loader_pb2.GetKeysResponse:
        shard = self.shards.get(request.shard_id)
        if shard is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no shard {request.shard_id!r} on this server")
        if request.count > MAX_KEYS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"count={request.count} is over the limit of {MAX_KEYS_PER_CALL} keys per call")
        end = min(request.start + request.count, len(shard))
        return loader_pb2.GetKeysResponse(keys=[shard.key(i) for i in range(request.start, end)])

    async def _pipeline(self, setup: loader_pb2.Setup) -> Pipeline:
        c = self.config
        for name, value in (("height", setup.height), ("width", setup.width)):
            if not c.min_image_size <= value <= c.max_image_size:
                raise PipelineError(f"{name}={value} is outside the sizes this server offers: "
                                    f"{c.min_image_size}..{c.max_image_size}")
        spec = PipelineSpec(setup.pipeline, setup.height, setup.width, setup.albumentations_json)
        pipeline = self._pipelines.get(spec)
        if pipeline is not None:
            return pipeline
        check = self._checks.get(spec)
        if check is None or check.future.cancelled():
            executor = self._preset_checks if spec.name in PRESETS else self._custom_checks
            check = self._checks[spec] = _Check(executor.submit(self._check_pipeline, spec))
            loop = asyncio.get_running_loop()
            check.future.add_done_callback(lambda f: loop.call_soon_threadsafe(self._checked, spec, check))
        check.waiters += 1
        try:
            return await asyncio.shield(asyncio.wrap_future(check.future))
        finally:
            check.waiters -= 1
            if not check.waiters:
                check.future.cancel()  # no client waits: dropped if queued; if running, cached when done

    def _check_pipeline(self, spec: PipelineSpec) -> Pipeline:
        started = time.perf_counter()
        pipeline = Pipeline(spec, self.config.allow_custom_pipelines, self.config.max_pixels)
        pipeline.check_output()
        log.info("pipeline %s %dx%d built and tried in %.2fs", spec.name, spec.height, spec.width,
                 time.perf_counter() - started)
        return pipeline

    def _checked(self, spec: PipelineSpec, check: "_Check") -> None:
        if self._checks.get(spec) is check:
            del self._checks[spec]
        if not check.future.cancelled() and check.future.exception() is None:
            if len(self._pipelines) > 64:
                self._pipelines.clear()
            self._pipelines[spec] = check.future.result()

    def close(self) -> None:
        """Stops the pipeline checks (queued ones are dropped; one running finishes on its own)."""
        for executor in (self._preset_checks, self._custom_checks):
            executor.shutdown(wait=False, cancel_futures=True)

    @property
    def active_streams(self) -> int:
        return sum(self._streams_by_client.values())

    async def Stream(self, request_iterator, context):
        peer = context.peer()
        client = _client_address(peer)
        c = self.config
        if self.active_streams >= c.max_streams or self._streams_by_client.get(client, 0) >= c.max_streams_per_client:
            self.metrics.refused.inc()
            limit = (f"max_streams={c.max_streams}" if self.active_streams >= c.max_streams
                     else f"max_streams_per_client={c.max_streams_per_client} (client {client})")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many open streams: this server's limit is {limit}")
        self._streams_by_client[client] = self._streams_by_client.get(client, 0) + 1
        self.metrics.active_streams.set(self.active_streams)
        try:
            await self._stream(context, peer)
        finally:
            self._streams_by_client[client] -= 1
            if not self._streams_by_client[client]:
                del self._streams_by_client[client]
            self.metrics.active_streams.set(self.active_streams)

    async def _stream(self, context, peer: str):
        c = self.config
        try:  # a stream that sends nothing would hold its place among max_streams
            first = await asyncio.wait_for(context.read(), c.stall_timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no Setup within stall_timeout={c.stall_timeout:g}s of opening the stream")
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed StreamRequest: {exc}")
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("kind") != "setup":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a stream must be a Setup")
        try:
            pipeline = await self._pipeline(first.setup)
        except PipelineError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        spec = pipeline.spec
        queue: asyncio.Queue = asyncio.Queue()
        state = {"inflight": 0, "slots": 0, "waiting": 0}
        log.info("stream opened by %s: pipeline %s %dx%d", peer, spec.name, spec.height, spec.width)
        reader = asyncio.create_task(self._read_orders(context, spec, queue, state))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], grpc.StatusCode):
                    await context.abort(*item)
                await self._write_chunk(context, spec, item, state)
        except _Stalled as stalled:
            log.warning("stream from %s: %s; ending it", peer, stalled)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the client {stalled}")
        finally:
            reader.cancel()
            # Slots still being written by a worker go back only when the worker is done.
            while not queue.empty():
                item = queue.get_nowait()
                if isinstance(item, _Pending):
                    item.future.add_done_callback(lambda _f, slot=item.slot: self._give_slot(slot, state))

    async def _read_orders(self, context, spec: PipelineSpec, queue: asyncio.Queue, state: dict) -> None:
        c = self.config
        sample_bytes = spec.height * spec.width * 3
        per_chunk = max(1, c.chunk_bytes // sample_bytes)
        drain = asyncio.ensure_future(self._draining.wait())
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                done, _ = await asyncio.wait({read, drain}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done:
                    read.cancel()
                    queue.put_nowait((grpc.StatusCode.UNAVAILABLE,
                                      "server is draining (SIGTERM or SIGINT); send unfinished orders elsewhere"))
                    return
                request = read.result()
                if request is grpc.aio.EOF:
                    queue.put_nowait(None)
                    return
                error = self._check_order(request, state)
                if error:
                    queue.put_nowait(error)
                    return
                received = time.monotonic()
                order = request.order
                shard = self.shards[order.shard_id]
                indices = np.asarray(order.indices, dtype=np.int64)
                seeds = sample_seeds(order.seed, order.epoch, self._shard_keys[shard.id], indices)
                state["inflight"] += 1
                for start in range(0, len(indices), per_chunk):
                    count = min(per_chunk, len(indices) - start)
                    if self.limiter is not None:
                        await self.limiter.take(count)
                    slot = await self._take_slot(state)
                    try:
                        future = self._render(spec, shard, indices[start:start + count], seeds[start:start + count],
                                              slot)
                    except BaseException:
                        self._give_slot(slot, state)
                        raise
                    queue.put_nowait(_Pending(order, shard, indices, start, count, slot, future, received))
        except asyncio.CancelledError:
            pass
        except DecodeError as exc:  # a message that is not a StreamRequest
            queue.put_nowait((grpc.StatusCode.INVALID_ARGUMENT, f"malformed StreamRequest: {exc}"))
        except Exception as exc:  # surface server bugs as a stream error, never a hang
            log.exception("stream reader failed")
            queue.put_nowait((grpc.StatusCode.INTERNAL, f"server error: {type(exc).__name__}: {exc}"))
        finally:
            drain.cancel()

    async def _take_slot(self, state: dict) -> int:
        """A slot for this stream, within its fair share of all slots.

        A stream may hold at most slots / open streams (at least 2, and never the last two
        while it is alone), so a stream that opens later gets its share as the others
        write theirs out. A client that does not read writes nothing out: while another
        stream waits here for a free slot, _send ends it after CONTENDED_STALL.
        """
        count = self.arena.count
        while state["slots"] >= max(2, min(count - 2, count // max(1, self.active_streams))):
            async with self._slot_freed:
                await self._slot_freed.wait()
        state["slots"] += 1
        # While none is free, the streams that hold slots and do not read are ended (_send).
        self._slot_waiters += 1
        state["waiting"] += 1
        try:
            return await self.arena.acquire()
        finally:
            self._slot_waiters -= 1
            state["waiting"] -= 1

    def _give_slot(self, slot: int, state: dict) -> None:
        state["slots"] -= 1
        self.arena.release(slot)
        asyncio.ensure_future(self._notify_slot_freed())

    async def _notify_slot_freed(self) -> None:
        async with self._slot_freed:
            self._slot_freed.notify_all()

    def _render(self, spec: PipelineSpec, shard: Shard, indices: np.ndarray, seeds: list[int],
                slot: int) -> asyncio.Future:
        """Starts rendering samples into a slot; the future gives [(position, reason)]."""
        if isinstance(shard, SyntheticShard):  # transport benchmark: the slot already holds pixels
            future = asyncio.get_running_loop().create_future()
            future.set_result([])
            return future
        locations, fills = [], []
        decoded = self._decoded[shard.id]
        for pos, index in enumerate(indices.tolist()):
            path, offset, length = shard.locate(index)
            mode, cache_offset = (self.cache.plan(shard.id, index, length) if self.cache is not None else (0, 0))
            if mode == 1:
                fills.append((pos, index, cache_offset))
            locations.append((path, offset, length, mode, cache_offset, bool(decoded[index])))
        # Split the chunk so that all workers share it (two tasks each), in tasks of
        # TASK_SAMPLES..MAX_TASK_SAMPLES samples: small enough to keep task messages small.
        size = min(MAX_TASK_SAMPLES, max(TASK_SAMPLES, -(-len(locations) // (2 * self.config.workers))))
        spec_tuple = (spec.name, spec.height, spec.width, spec.albumentations_json)
        firsts = range(0, len(locations), size)
        parts = [self.pool.submit(Task(slot, first, spec_tuple, locations[first:first + size],
                                       seeds[first:first + size])) for first in firsts]
        future = _merge(parts, list(firsts))

        def done(f: asyncio.Future) -> None:
            # What decoded cleanly may be region-decoded next time, and its cache fill stands.
            failed = {pos for pos, _ in f.result()} if not f.cancelled() else None
            if failed is not None:
                ok = np.ones(len(indices), np.bool_)
                ok[list(failed)] = False
                decoded[indices[~ok]] = False  # decoded whole again next time
                decoded[indices[ok]] = True
            for pos, index, cache_offset in fills:
                self.cache.filled(shard.id, index, cache_offset, failed is not None and pos not in failed)

        future.add_done_callback(done)
        return future

    def _check_order(self, request, state: dict):
        c = self.config
        if request.WhichOneof("kind") != "order":
            return grpc.StatusCode.INVALID_ARGUMENT, "only the first message of a stream may be a Setup"
        order = request.order
        if order.shard_id not in self.shards:
            return grpc.StatusCode.INVALID_ARGUMENT, (f"order {order.order_id}: no shard {order.shard_id!r} on this "
                                                      f"server; it holds {', '.join(self.shards)}")
        n = len(order.indices)
        if not 0 < n <= c.max_order_samples:
            return grpc.StatusCode.INVALID_ARGUMENT, (f"order {order.order_id} has {n} samples; "
                                                      f"expected 1..{c.max_order_samples} (max_order_samples)")
        size = len(self.shards[order.shard_id])
        if max(order.indices) >= size:
            return grpc.StatusCode.INVALID_ARGUMENT, (f"order {order.order_id}: index {max(order.indices)} is out of "
                                                      f"range for shard {order.shard_id} of {size} samples")
        if state["inflight"] >= c.max_inflight_orders:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, (f"more than max_inflight_orders={c.max_inflight_orders} "
                                                        f"orders in flight on one stream")
        return None

    async def _write_chunk(self, context, spec: PipelineSpec, item: "_Pending", state: dict) -> None:
        try:
            # Shielded: a cancelled stream must not cancel the chunk's future, which completes
            # only when every worker task is done with the slot.
            errors = await asyncio.shield(item.future)
            indices = item.indices[item.start:item.start + item.count]
            header = loader_pb2.ChunkHeader(
                order_id=item.order.order_id, start=item.start, count=item.count, order_size=len(item.indices),
                height=spec.height, width=spec.width, channels=3, labels=item.shard.labels[indices].tolist(),
                errors=[loader_pb2.SampleError(position=item.start + pos, index=int(indices[pos]),
                                               key=item.shard.key(int(indices[pos])), reason=reason)
                        for pos, reason in errors])
            nbytes = item.count * spec.height * spec.width * 3
            await self._send(context, OutChunk(header, self.arena.view(item.slot, nbytes)), state)
            m = self.metrics
            m.images.inc(item.count)
            m.bytes.inc(nbytes)
            if errors:
                m.decode_errors.inc(len(errors))
        finally:
            if item.future.done():
                self._give_slot(item.slot, state)
            else:
                item.future.add_done_callback(lambda _f, slot=item.slot: self._give_slot(slot, state))
        if item.start + item.count == len(item.indices):
            state["inflight"] -= 1
            self.metrics.orders.inc()
            self.metrics.order_latency.observe(time.monotonic() - item.received)

    async def _send(self, context, chunk: OutChunk, state: dict) -> None:
        """Writes a chunk, or raises _Stalled when the client leaves it unread for
        stall_timeout, or for CONTENDED_STALL while another stream waits for a free slot."""
        write = asyncio.ensure_future(context.write(chunk))
        started = time.monotonic()
        stall = self.config.stall_timeout
        try:
            while not (await asyncio.wait({write}, timeout=min(1.0, stall)))[0]:
                waited = time.monotonic() - started
                if waited >= stall:
                    raise _Stalled(f"read nothing for stall_timeout={stall:g}s")
                if waited >= CONTENDED_STALL and self._slot_waiters > state["waiting"]:
                    raise _Stalled(f"read nothing for {waited:.0f}s while streams waited for the chunk slots it holds")
        except BaseException:  # stalled, or this stream is ending: the write must not outlive it
            write.cancel()
            raise
        write.result()


def _merge(parts: list[asyncio.Future], firsts: list[int]) -> asyncio.Future:
    """One future for a chunk's tasks: their errors, with positions relative to the chunk.

    Unlike gather, it completes only when every part has, so the slot is never released
    while a worker may still write into it.
    """
    loop = asyncio.get_running_loop()
    merged = loop.create_future()
    remaining = [len(parts)]

    def done(_f: asyncio.Future) -> None:
        remaining[0] -= 1
        if remaining[0] == 0 and not merged.done():
            errors = []
            for first, part in zip(firsts, parts):
                errors.extend((first + pos, reason) for pos, reason in part.result())
            merged.set_result(errors)

    for part in parts:
        part.add_done_callback(done)
    return merged


class _Check:
    """A pipeline being built and tried in a thread, and how many Setups wait for it."""

    def __init__(self, future: concurrent.futures.Future):
        self.future = future
        self.waiters = 0


class _Stalled(Exception):
    """The client stopped reading: a chunk waited too long to be sent (see _send); says why."""


class RateLimiter:
    """Spaces out work so that at most ``rate`` samples per second are rendered, server-wide."""

    def __init__(self, rate: float):
        self.rate = rate
        self._next = 0.0

    async def take(self, count: int) -> None:
        """Waits until ``count`` samples fit in the budget, the first ones included."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._next = max(now, self._next) + count / self.rate
        await asyncio.sleep(self._next - now)


class _Pending(NamedTuple):
    order: loader_pb2.Order
    shard: Shard
    indices: np.ndarray
    start: int
    count: int
    slot: int
    future: asyncio.Future
    received: float


def _client_address(peer: str) -> str:
    """'ipv4:10.0.0.5:41234' -> 'ipv4:10.0.0.5' (streams are counted per client host)."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
