"""Scheduling and reassembly, on the client's I/O event loop.

Each batch of the plan is split by owning shard into orders. Orders wait in one FIFO and
go to the least-loaded live server that owns their shard, at most ``max_inflight`` per
server (credits: the memory bound). Chunks are copied once, straight into their rows of
the batch buffer. When a server fails, its unfinished orders return to the front of the
FIFO, for another owner or for the same server once it is back; an order is complete
only when all its samples have arrived, so nothing is lost or duplicated.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from remoteloader.client.catalog import Catalog, ShardInfo
from remoteloader.client.link import Link, describe_error, is_fatal
from remoteloader.protos import loader_pb2

log = logging.getLogger("remoteloader.client")

END = object()  # end of an epoch, in the output queue


class LoaderError(RuntimeError):
    """A batch cannot be delivered; the message names the server(s) and samples."""


@dataclass(frozen=True)
class SampleFailure:
    """A sample a server could not decode or augment."""

    sample_id: int
    key: str
    reason: str
    server: str


@dataclass
class Batch:
    seq: int
    ids: np.ndarray
    images: object  # torch.Tensor, uint8 NHWC, filled in place
    pixels: np.ndarray  # numpy view of images
    labels: np.ndarray
    remaining: int
    failures: list[SampleFailure] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Order:
    order_id: int
    batch: Batch
    shard: ShardInfo
    positions: np.ndarray  # rows of the batch
    local: np.ndarray  # shard-local indices
    epoch: int
    received: int = 0
    cancelled: bool = False
    link: Link | None = None
    failures: list = field(default_factory=list)  # merged into the batch when the order completes
    nbytes: int = 0


class Engine:
    """Owns the links and runs one epoch at a time; lives on the I/O loop thread."""

    def __init__(self, links: dict[str, Link], catalog: Catalog, setup: loader_pb2.Setup, *, seed: int,
                 prefetch: int, ordered: bool, reconnect_timeout: float, delivery, progress_timeout: float = 60.0):
        self.links = links
        self.catalog = catalog
        self.setup = setup
        self.seed = seed
        self.prefetch = prefetch
        self.ordered = ordered
        self.reconnect_timeout = reconnect_timeout
        self.delivery = delivery  # allocate(n, h, w) -> uint8 NHWC tensor or None; release(tensor)
        self.out: queue.Queue = queue.Queue()
        self.order_size = 1
        self._order_ids = itertools.count(1)
        self._pending: deque[_Order] = deque()
        self._reconnecting: dict[str, asyncio.Task] = {}
        self._run: _Run | None = None
        self._tokens = itertools.count(1)
        self.progress_timeout = progress_timeout
        self._watchdog: asyncio.Task | None = None

    # ---- epochs ---------------------------------------------------------------------
    async def start_epoch(self, epoch: int, batches: list[np.ndarray], first_seq: int,
                          catalog: Catalog | None = None, skip: frozenset = frozenset()) -> int:
        """Starts an epoch at batch ``first_seq`` (leaving out the batches in ``skip``); returns its token."""
        self.cancel_epoch()
        if catalog is not None:
            self.catalog = catalog
        self.order_size = min(l.describe.max_order_samples for l in self.links.values() if l.describe)
        for link in self.links.values():
            if link.state == "new":
                await link.open_stream(self.setup)
            elif link.state in ("down", "dead") and link.address not in self._reconnecting:
                # given up on (or refused) earlier: it gets another reconnect_timeout
                link.down_afresh()
                self._reconnecting[link.address] = asyncio.ensure_future(self._reconnect(link))
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch_progress())
        self.out = queue.Queue()
        self._run = _Run(next(self._tokens), epoch, batches, first_seq, self.out, skip)
        if self._run.expected == 0:
            self.out.put(END)
            return self._run.token
        self._dispatch()
        return self._run.token

    @property
    def token(self) -> int | None:
        """The running epoch's token (read from the consumer thread)."""
        run = self._run
        return run.token if run is not None else None

    def cancel_epoch(self, token: int | None = None, drain: bool = True) -> None:
        """Abandons the current epoch, if ``token`` is still it; in-flight work is dropped."""
        if self._run is None or (token is not None and self._run.token != token):
            return
        self._run.cancelled = True
        for batch in self._run.open.values():  # never handed out: their buffers are free again
            self.delivery.release(batch.images)
        self._run.open.clear()
        while drain:  # handed out but never taken by the consumer
            try:
                item = self._run.out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Batch):
                self.delivery.release(item.images)
        for order in self._pending:
            order.cancelled = True
        self._pending.clear()
        for link in self.links.values():
            for order in link.inflight.values():
                order.cancelled = True
        self._run = None

    def consumed(self, token: int) -> None:
        if self._run is not None and self._run.token == token:
            self._run.consumed += 1
            self._dispatch()

    def buffer_freed(self) -> None:
        if self._run is not None and not self._run.cancelled:
            self._dispatch()

    def _dispatch(self) -> None:
        run = self._run
        h, w = self.setup.height, self.setup.width
        while True:
            while run.next_dispatch in run.skip:
                run.next_dispatch += 1
            if run.next_dispatch >= len(run.batches) or run.dispatched - run.consumed >= self.prefetch:
                break
            seq = run.next_dispatch
            ids = run.batches[seq]
            images = self.delivery.allocate(len(ids), h, w)
            if images is None:  # every pinned buffer is in use: resume when one comes back
                break
            run.next_dispatch += 1
            run.dispatched += 1
            pixels = images if isinstance(images, np.ndarray) else images.numpy()
            batch = Batch(seq, ids, images, pixels, np.full(len(ids), -1, np.int64), len(ids))
            run.open[seq] = batch
            shard_idx = self.catalog.shard_of(ids)
            for s in np.unique(shard_idx):
                shard = self.catalog.shards[int(s)]
                positions = np.flatnonzero(shard_idx == s)
                local = ids[positions] - shard.offset
                for start in range(0, len(positions), self.order_size):
                    self._pending.append(_Order(next(self._order_ids), batch, shard, positions[start:start + self.order_size],
                                                local[start:start + self.order_size], run.epoch))
        self._pump()

    # ---- scheduling -----------------------------------------------------------------
    def _pump(self) -> None:
        """Sends pending orders, oldest first, each to the owner expected to finish it first.

        A server's expected finish is (samples it already holds + this order) / its measured
        rate, so a replica twice as fast gets about twice the work. An order waits rather
        than go to a server with credits when a busier but faster owner would still finish
        it sooner (by more than half again).
        """
        for order in list(self._pending):
            owners = [l for l in (self.links.get(a) for a in order.shard.owners) if l is not None and l.state == "up"]
            if not owners:
                continue
            default_rate = max((l.rate for l in owners if l.rate), default=1000.0)
            n = len(order.positions)

            def finish(link: Link) -> float:
                return (link.outstanding + n) / (link.rate or default_rate)

            ready = [l for l in owners if l.credits > 0]
            if not ready:
                continue
            best = min(ready, key=finish)
            if finish(best) > 1.5 * min(finish(l) for l in owners):
                continue
            self._pending.remove(order)
            self._send(best, order)
        self._check_stranded()

    def _send(self, link: Link, order: _Order) -> None:
        order.link = link
        order.received = 0
        order.failures = []
        order.nbytes = 0
        link.inflight[order.order_id] = order
        link.outstanding += len(order.positions)
        link.send(loader_pb2.Order(order_id=order.order_id, shard_id=order.shard.id, indices=order.local.tolist(),
                                   seed=self.seed, epoch=order.epoch))

    # ---- receiving ------------------------------------------------------------------
    def on_chunk(self, link: Link, chunk) -> None:
        header, pixels = chunk
        order = link.inflight.get(header.order_id)
        n = len(order.positions) if order is not None else 0
        h, w = self.setup.height, self.setup.width
        expected = header.count * h * w * 3
        if (order is None or header.start != order.received or header.start + header.count > n
                or header.count == 0 or header.height != h
                or header.width != w or header.channels != 3 or len(pixels) != expected
                or len(header.labels) != header.count):
            link._fail(ConnectionError(
                f"malformed chunk from {link.address} (order {header.order_id}, start {header.start}, "
                f"count {header.count}, {len(pixels)} pixel bytes, expected {expected})"))
            return
        link.bytes_received += len(pixels)
        link.record(header.count)
        if not order.cancelled:
            batch = order.batch
            rows = order.positions[header.start:header.start + header.count]
            block = np.frombuffer(pixels, dtype=np.uint8).reshape(header.count, h, w, 3)
            if rows[-1] - rows[0] == len(rows) - 1:  # contiguous rows: one slice copy
                batch.pixels[rows[0]:rows[-1] + 1] = block
            else:
                batch.pixels[rows] = block
            batch.labels[rows] = self.catalog.global_labels(order.shard, np.asarray(header.labels, dtype=np.int64))
            order.nbytes += len(pixels)
            for e in header.errors:
                if header.start <= e.position < header.start + header.count:
                    row = order.positions[e.position]
                    order.failures.append(SampleFailure(int(batch.ids[row]), e.key, e.reason, link.address))
        order.received += header.count
        if order.received == n:
            del link.inflight[order.order_id]
            link.outstanding -= n
            link.samples_received += n
            if not order.cancelled:
                # Only now: a server that failed half-way must not leave its reports behind.
                order.batch.failures.extend(order.failures)
                order.batch.nbytes += order.nbytes
                order.batch.remaining -= n
                if order.batch.remaining == 0:
                    self._run.complete(order.batch, self.ordered)
            self._pump()

    # ---- failures -------------------------------------------------------------------
    def on_link_down(self, link: Link, exc: Exception) -> None:
        orders = [o for o in link.inflight.values() if not o.cancelled]
        link.inflight.clear()
        link.outstanding = 0
        for order in sorted(orders, key=lambda o: o.order_id, reverse=True):
            self._pending.appendleft(order)
        if is_fatal(exc):  # the request itself is refused: retrying this server cannot help
            log.error("loader server %s refused this client: %s", link.address, describe_error(exc))
            link.state = "dead"
            link.gave_up = f"refused: {describe_error(exc)}"
        else:
            log.warning("loader server %s failed (%s); %d order(s) go back to the queue",
                        link.address, describe_error(exc), len(orders))
            if link.address not in self._reconnecting:
                self._reconnecting[link.address] = asyncio.ensure_future(self._reconnect(link))
        self._pump()

    async def _reconnect(self, link: Link) -> None:
        # The back-off carries over when a server fails again before sending anything
        # (one that refuses each new stream, e.g. RESOURCE_EXHAUSTED): no tight retry loop.
        delay = link.retry_delay
        deadline = link.down_since + self.reconnect_timeout
        try:
            while time.monotonic() < deadline and link.state == "down":
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 2.0)
                try:
                    await link.reset_channels()
                    await link.fetch_describe(max(0.5, min(link.connect_timeout, deadline - time.monotonic())))
                    await link.open_stream(self.setup)
                except Exception as exc:  # still down; try again until the deadline
                    link.last_error = describe_error(exc)
                    continue
                link.reconnects += 1
                link.retry_delay = delay  # the next failure's first wait, unless this stream works
                log.info("loader server %s is back", link.address)
                self._pump()
                return
            if link.state == "down":
                link.state = "dead"
                link.gave_up = (f"unreachable for more than reconnect_timeout={self.reconnect_timeout:g}s "
                                f"({link.last_error})")
            self._reconnecting.pop(link.address, None)  # no longer hopeful: check what it strands
            self._check_stranded()
        finally:
            self._reconnecting.pop(link.address, None)

    def _check_stranded(self) -> None:
        """Fails the epoch when pending work has no owner that is up or coming back."""
        if not self._pending:
            return
        hopeful = {a for a, l in self.links.items() if l.state == "up" or a in self._reconnecting}
        for order in self._pending:
            if not any(owner in hopeful for owner in order.shard.owners):
                owners = [self.links[o] for o in order.shard.owners if o in self.links]
                detail = "; ".join(f"{l.address}: {l.gave_up or l.last_error or l.state}" for l in owners)
                ids = order.batch.ids[order.positions]
                self.fail(LoaderError(
                    f"no loader server can serve shard {order.shard.name} ({order.shard.id}): {detail}; "
                    f"{len(ids)} sample(s) of batch {order.batch.seq} could not be served, ids "
                    f"{_abbrev(ids.tolist())}"))
                return

    async def _watch_progress(self) -> None:
        """Fails a server that holds orders but sent nothing for progress_timeout (it is stuck)."""
        while True:
            await asyncio.sleep(min(2.0, self.progress_timeout / 4))
            now = time.monotonic()
            for link in list(self.links.values()):
                if link.state == "up" and link.inflight and now - link.last_progress > self.progress_timeout:
                    link._fail(TimeoutError(f"no data for progress_timeout={self.progress_timeout:g}s with "
                                            f"{len(link.inflight)} order(s) in flight"))

    def fail(self, error: BaseException) -> None:
        run = self._run
        if run is not None and not run.cancelled:
            self.cancel_epoch(drain=False)  # the consumer takes what is ready, then the error
            run.out.put(error)

    async def close(self) -> None:
        self.cancel_epoch()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._reconnecting.values()):
            task.cancel()
        for link in list(self.links.values()):  # discovery may add or drop links meanwhile
            await link.close()


class _Run:
    """One epoch's batches, from ``first_seq`` on, less ``skip`` (already delivered before a resume)."""

    def __init__(self, token: int, epoch: int, batches: list[np.ndarray], first_seq: int, out: queue.Queue,
                 skip: frozenset = frozenset()):
        self.token = token
        self.epoch = epoch
        self.batches = batches
        self.first_seq = first_seq
        self.skip = frozenset(s for s in skip if first_seq <= s < len(batches))
        self.expected = len(batches) - first_seq - len(self.skip)
        self.next_dispatch = first_seq
        self.next_deliver = first_seq
        self.dispatched = 0
        self.consumed = 0
        self.delivered = 0
        self.ready: dict[int, Batch] = {}
        self.open: dict[int, Batch] = {}  # dispatched, not yet handed out
        self.out = out
        self.cancelled = False

    def complete(self, batch: Batch, ordered: bool) -> None:
        if self.cancelled:
            return
        if not ordered:
            self._emit(batch)
            return
        self.ready[batch.seq] = batch
        while True:
            while self.next_deliver in self.skip:
                self.next_deliver += 1
            if self.next_deliver not in self.ready:
                return
            self._emit(self.ready.pop(self.next_deliver))
            self.next_deliver += 1

    def _emit(self, batch: Batch) -> None:
        self.open.pop(batch.seq, None)
        self.out.put(batch)
        self.delivered += 1
        if self.delivered == self.expected:
            self.out.put(END)


def _abbrev(items: list, limit: int = 20) -> str:
    return str(items) if len(items) <= limit else f"{items[:limit]}... ({len(items)} in all)"
