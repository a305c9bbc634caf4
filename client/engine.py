"""Scheduling and reassembly, on the client's I/O event loop.

Each batch of the plan is split by owning shard into orders. Orders wait in one FIFO and
each goes to the live server owning its shard that is expected to finish it first (by the
samples it holds and its measured rate), at most ``max_inflight`` per server (credits: the
memory bound). Chunks are copied once, straight into their rows of the batch buffer
(pixels, then masks), and their targets are checked and kept per row. When a server fails,
its unfinished orders return to the front of the FIFO, for another owner or for the same
server once it is back; an order is complete only when all its samples have arrived, so
nothing is lost or duplicated. Orders have deadlines (when the loop will want their batch):
a slower replica gets only the work it can finish by then (``_pump``). When a server has
nothing left to do while a slower replica holds an order the loop will wait for, it is sent
a twin of that order's rest (``_hedge``): whichever completes first fills the batch, and the
other is cancelled on its server, what it still sends dropped (both carry the same pixels: a
sample's augmentation does not depend on the server).

The links own their connections (state, back-off, orders in flight: ``link.py``) and the
receiver owns the links (it makes, drops and closes them); the engine decides where orders
go and puts batches together.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from remoteloader.client.batches import END, Batch, Item, LoaderError, SampleFailure
from remoteloader.client.link import Link, LinkState, describe_error
from remoteloader.client.sample_space import SampleSpace, ShardInfo
from remoteloader.protos import codec, limits, loader_pb2, wire
from remoteloader.protos import targets as tg

if TYPE_CHECKING:
    import torch

__all__ = ["END", "Batch", "BatchBuffers", "Engine", "EngineOptions", "LoaderError", "SampleFailure"]

log = logging.getLogger("remoteloader.client")

MIN_SPLIT = 16  # fewest samples an order is split off into, for a slower server to finish in time
SAFETY = 0.8  # the share of the time to an order's deadline a slower server is given work for
SLOW = 3  # a server this many times slower than the fastest holds one order at a time


class BatchBuffers(Protocol):
    """Where the engine receives batches: memory the consumer's side lends, one buffer per batch."""

    def allocate(self, n: int, h: int, w: int) -> torch.Tensor | np.ndarray | None:
        """A uint8 (n, h, w, 3) buffer, or None when none is free (``Engine.buffer_freed`` follows)."""

    def masks_for(self, images: Any, n: int, h: int, w: int) -> np.ndarray:
        """A uint8 (n, h, w) array for the masks of the batch received into ``images`` (in the
        same lent memory where the buffers have room for masks)."""

    def release(self, images: Any) -> None:
        """Takes back the buffer of a batch dropped before it was handed out."""


@dataclass(frozen=True)
class EngineOptions:
    """RemoteLoader's scheduling arguments of the same names (no defaults: RemoteLoader's are the ones)."""

    seed: int
    prefetch: int
    ordered: bool
    progress_timeout: float


@dataclass
class _Order:
    """A part of one batch for one shard: what a server is asked for in one message."""

    order_id: int
    batch: Batch
    shard: ShardInfo
    positions: np.ndarray  # rows of the batch
    local: np.ndarray  # shard-local indices
    epoch: int
    received: int = 0
    cancelled: bool = False
    failures: list[SampleFailure] = field(default_factory=list)  # merged into the batch when the order completes
    nbytes: int = 0
    twin: _Order | None = None  # its rest sent to another server too (_hedge); the first to complete wins
    credited: int = 0  # its first samples already counted into the batch (when it was hedged)
    sent_to: str = ""  # the server it was last sent to

    @property
    def samples(self) -> int:
        return len(self.positions)


class Engine:
    """Runs one epoch at a time over the receiver's links; lives on the I/O loop thread.

    Args:
        links: The receiver's links by address. The receiver owns them: it adds, drops and
            closes them; the engine opens their streams, sends orders and reads their state.
        setup: The stream's Setup message (output height and width).
        options: Seed, prefetch, ordering and the progress timeout.
        buffers: Where batches are received.
    """

    def __init__(
        self, links: dict[str, Link[_Order]], setup: loader_pb2.Setup, options: EngineOptions, buffers: BatchBuffers
    ):
        self.links = links
        self.setup = setup
        self.options = options
        self.buffers = buffers
        self.space: SampleSpace | None = None  # the running (or last) epoch's
        self.out: queue.Queue[Item] = queue.Queue()
        self.order_size = 1
        self.fields = tuple(f for f in setup.fields if f != tg.MASK)  # the targets kept per row
        self.masks = tg.MASK in setup.fields
        self.encoded = setup.wire not in ("", wire.RAW)  # chunks carry encoded parts (protos.wire)
        self._sample_bytes = limits.sample_bytes(setup.height, setup.width, self.masks)  # (per chunk: hoisted)
        self._order_ids = itertools.count(1)
        self._pending: list[_Order] = []  # FIFO: failed orders go back to its front
        self._run: _Run | None = None
        self._tokens = itertools.count(1)
        self._watchdog: asyncio.Task | None = None

    # ---- epochs ---------------------------------------------------------------------
    async def start_epoch(
        self, *, epoch: int, batches: list[np.ndarray], first_seq: int, space: SampleSpace, skip: frozenset[int]
    ) -> int:
        """Starts an epoch at batch ``first_seq`` (leaving out the batches in ``skip``); returns its token."""
        self.cancel_epoch()
        self.space = space
        self.order_size = min(link.describe.max_order_samples for link in self.links.values() if link.describe)
        for link in self.links.values():
            if link.state is LinkState.NEW:
                await link.open_stream(self.setup)
            else:
                link.revive()  # given up on (or refused) earlier: it gets another reconnect_timeout
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch_progress())
        self.out = queue.Queue()
        self._run = run = _Run(next(self._tokens), epoch, batches, first_seq, self.out, skip)
        if run.expected == 0:
            self.out.put(END)
            return run.token
        self._dispatch(run)
        return run.token

    @property
    def token(self) -> int | None:
        """The running epoch's token (read from the consumer thread)."""
        run = self._run
        return run.token if run is not None else None

    def cancel_epoch(self, token: int | None = None, drain: bool = True) -> None:
        """Abandons the current epoch, if ``token`` is still it; in-flight work is dropped."""
        run = self._run
        if run is None or (token is not None and run.token != token):
            return
        run.cancelled = True
        for batch in run.open.values():  # never handed out: their buffers are free again
            self.buffers.release(batch.images)
        run.open.clear()
        while drain:  # handed out but never taken by the consumer
            try:
                item = run.out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Batch):
                self.buffers.release(item.images)
        for order in self._pending:
            order.cancelled = True
        self._pending.clear()
        for link in self.links.values():
            for order in link.orders():
                order.cancelled = True
        self._run = None

    def consumed(self, token: int) -> None:
        """The consumer took a batch of epoch ``token``: one more may be requested."""
        run = self._run
        if run is not None and run.token == token:
            run.consumed += 1
            self._dispatch(run)

    def buffer_freed(self) -> None:
        """A buffer came back: dispatching may go on where ``allocate`` found none."""
        if self._run is not None and not self._run.cancelled:
            self._dispatch(self._run)

    def _dispatch(self, run: _Run) -> None:
        """Turns plan batches into orders, up to ``prefetch`` batches ahead of the consumer."""
        assert self.space is not None, "an epoch runs over a sample space"
        space = self.space
        h, w = self.setup.height, self.setup.width
        while True:
            while run.next_dispatch in run.skip:
                run.next_dispatch += 1
            if run.next_dispatch >= len(run.batches) or run.dispatched - run.consumed >= self.options.prefetch:
                break
            seq = run.next_dispatch
            ids = run.batches[seq]
            images = self.buffers.allocate(len(ids), h, w)
            if images is None:  # every buffer is in use: resume when one comes back
                break
            run.next_dispatch += 1
            run.dispatched += 1
            pixels = images if isinstance(images, np.ndarray) else images.numpy()
            batch = Batch(seq, ids, images, pixels, np.full(len(ids), -1, np.int64), len(ids))
            if self.masks:
                batch.masks = self.buffers.masks_for(images, len(ids), h, w)
            batch.targets = {name: [None] * len(ids) for name in self.fields}
            run.open[seq] = batch
            shard_idx = space.shard_of(ids)
            for s in np.unique(shard_idx):
                shard = space.shards[int(s)]
                positions = np.flatnonzero(shard_idx == s)
                local = ids[positions] - shard.offset
                for start in range(0, len(positions), self.order_size):
                    part = slice(start, start + self.order_size)
                    self._pending.append(
                        _Order(next(self._order_ids), batch, shard, positions[part], local[part], run.epoch)
                    )
        self._pump()

    # ---- scheduling -----------------------------------------------------------------
    def _pump(self) -> None:
        """Sends pending orders, oldest first, each to the owner expected to finish it first.

        A server's expected finish is (samples it already holds + this order) / its measured
        rate, so a replica twice as fast gets about twice the work. Each order also has a
        deadline: when the training loop will want its batch (the samples before it, at all
        the servers' rates together; for unordered delivery, the end of the epoch). An order
        goes to the ready owner that finishes it first if that is before its deadline, or if
        no owner, busy or not, would finish it sooner (by more than half again); otherwise it
        waits for a faster owner, or a slower one takes the part of it that it can finish in
        time (the order is split). So a slow replica (a slow link) takes its share of the
        epoch from batches far enough ahead, and never holds the batch the loop waits for.
        """
        pace = self._pace()
        for order in list(self._pending):
            owners = [
                link
                for link in (self.links.get(a) for a in order.shard.owners)
                if link is not None and link.state is LinkState.UP
            ]
            default_rate = max((link.rate for link in owners if link.rate), default=1000.0)
            ready = [link for link in owners if self._credits(link, default_rate) > 0]
            if not ready:
                continue
            finish = {link.address: (link.outstanding + order.samples) / (link.rate or default_rate) for link in owners}
            best = min(ready, key=lambda link: finish[link.address])
            deadline = self._deadline(order, pace)
            if finish[best.address] > max(1.5 * min(finish.values()), deadline):
                # Too slow for all of it: the part it can finish before the deadline.
                room = int(SAFETY * deadline * (best.rate or default_rate)) - best.outstanding
                if room < MIN_SPLIT or room >= order.samples:
                    continue
                order = self._split(order, room)
            else:
                self._pending.remove(order)
            self._send(best, order)
        self._hedge()
        self._check_stranded()

    @staticmethod
    def _credits(link: Link[_Order], fastest: float) -> int:
        """Orders ``link`` may be sent now: its credits, and one order at a time for a server
        several times slower than the fastest (so that it never holds more than it can finish
        by the deadline it was given, whatever its link buffers)."""
        if link.rate and link.rate * SLOW < fastest:
            return min(link.credits, 1 - len(link.orders()))
        return link.credits

    def _pace(self) -> float:
        """Samples per second all the servers that are up deliver together (measured)."""
        up = [link for link in self.links.values() if link.state is LinkState.UP]
        default_rate = max((link.rate for link in up if link.rate), default=1000.0)
        return sum(link.rate or default_rate for link in up) or default_rate

    def _deadline(self, order: _Order, pace: float) -> float:
        """Seconds until the training loop wants ``order``'s batch: the samples it takes first
        (those of the batches before it; with ordered=False, the rest of the epoch) over ``pace``."""
        run = self._run
        if run is None:
            return 0.0
        if not self.options.ordered:
            left = run.samples_after(run.next_dispatch) + sum(o.samples for o in self._pending)
            return (left + sum(link.outstanding for link in self.links.values())) / pace
        return (run.samples_after(run.next_deliver) - run.samples_after(order.batch.seq)) / pace

    def _split(self, order: _Order, count: int) -> _Order:
        """Takes ``order``'s first ``count`` samples out as an order of their own (``order`` keeps
        the rest and its place in the queue); returns it."""
        head = _Order(
            next(self._order_ids), order.batch, order.shard, order.positions[:count], order.local[:count], order.epoch
        )
        order.positions, order.local = order.positions[count:], order.local[count:]
        return head

    def _hedge(self) -> None:
        """Sends each server that has nothing in flight, when no order is pending, a twin of the
        rest of the oldest order a slower replica holds that will be late (the loop would wait
        for it) and that it would finish sooner (by more than half again): a slow server's
        estimate gone wrong, or a server slowed down, does not hold up the batches behind it."""
        if self._pending or self._run is None:
            return
        up = [link for link in self.links.values() if link.state is LinkState.UP]
        default_rate = max((link.rate for link in up if link.rate), default=1000.0)
        pace = self._pace()
        for link in up:
            if link.outstanding or link.credits <= 0:
                continue
            oldest: _Order | None = None
            for other in up:
                if other is link:
                    continue
                ahead = 0  # samples the other server sends before this order's last one
                for order in other.orders():
                    ahead += order.samples - order.received
                    if order.cancelled or order.twin is not None or link.address not in order.shard.owners:
                        continue
                    there = ahead / (other.rate or default_rate)
                    late = there > self._deadline(order, pace)  # the loop would wait for it
                    if late and there > 1.5 * order.samples / (link.rate or default_rate):
                        if oldest is None or order.order_id < oldest.order_id:
                            oldest = order
                        break
            if oldest is not None:
                # What arrived of it stays; the twin is the rest.
                done = oldest.received
                self._credit(oldest, done - oldest.credited)
                oldest.credited = done
                twin = _Order(
                    next(self._order_ids),
                    oldest.batch,
                    oldest.shard,
                    oldest.positions[done:],
                    oldest.local[done:],
                    oldest.epoch,
                )
                twin.twin, oldest.twin = oldest, twin
                self._send(link, twin)

    def _send(self, link: Link[_Order], order: _Order) -> None:
        order.sent_to = link.address
        order.received = 0
        order.failures = []
        order.nbytes = 0
        link.send(
            order,
            loader_pb2.Order(
                order_id=order.order_id,
                shard_id=order.shard.id,
                indices=order.local.tolist(),
                seed=self.options.seed,
                epoch=order.epoch,
            ),
        )

    # ---- receiving (LinkEvents) -----------------------------------------------------
    def on_chunk(self, link: Link[_Order], chunk: codec.DecodedChunk) -> None:
        """Copies a chunk's pixels and labels into its batch's rows; completes orders and batches."""
        header, pixels = chunk
        shared = header.shared if header.HasField("shared") else None  # its pixels in the server's memory
        if shared is not None:
            try:
                pixels = link.shared_payload(shared)
            except ValueError as exc:
                link.fail(ConnectionError(f"bad shared chunk from {link.address} (order {header.order_id}): {exc}"))
                return
        order = link.order(header.order_id)
        if order is None and link.dropped(header.order_id):  # already on the way when it was cancelled
            link.received(len(pixels), header.count, header.workers_busy)
            if shared is not None:
                link.release(shared)
            return
        h, w = self.setup.height, self.setup.width
        expected = header.count * self._sample_bytes
        if (
            order is None
            or header.start != order.received
            or header.start + header.count > order.samples
            or header.count == 0
            or header.height != h
            or header.width != w
            or header.channels != limits.CHANNELS
            or (len(pixels) > expected if self.encoded else len(pixels) != expected)
            or len(header.labels) != header.count
            or len(header.targets) != (header.count if self.setup.fields else 0)
        ):
            link.fail(
                ConnectionError(
                    f"malformed chunk from {link.address} (order {header.order_id}, start {header.start}, "
                    f"count {header.count}, {len(pixels)} pixel bytes, expected {expected})"
                )
            )
            return
        parts = None
        if self.encoded:  # each sample's part of the payload (Setup.wire), checked before any is read
            try:
                image, mask = limits.sample_bytes(h, w), h * w if self.masks else 0
                parts = wire.parts(list(header.encoded_sizes), header.count, image, mask, len(pixels))
            except ValueError as exc:
                link.fail(ConnectionError(f"malformed chunk from {link.address} (order {header.order_id}): {exc}"))
                return
        targets = None
        if self.fields and not order.cancelled:
            try:
                targets = [tg.arrays_of(t) for t in header.targets]
            except tg.TargetError as exc:
                link.fail(ConnectionError(f"malformed targets from {link.address} (order {header.order_id}): {exc}"))
                return
        link.received(len(pixels), header.count, header.workers_busy)
        if not order.cancelled:
            assert self.space is not None, "orders are only sent while an epoch runs"
            batch = order.batch
            rows = order.positions[header.start : header.start + header.count]
            first = int(rows[0])
            # where the rows are in the batch's arrays: a slice when they are consecutive (the usual case)
            where = slice(first, first + len(rows)) if rows[-1] - first == len(rows) - 1 else rows
            if parts is None:
                self._copy(batch, order.shard, where, pixels)
            else:
                try:
                    self._decode(batch, order.shard, rows, pixels, parts)
                except ValueError as exc:
                    link.fail(
                        ConnectionError(
                            f"bad {self.setup.wire} chunk from {link.address} (order {header.order_id}, "
                            f"start {header.start}): {exc}"
                        )
                    )
                    return
            if shared is not None and not link.release(shared):
                link.fail(
                    ConnectionError(
                        f"shared chunk from {link.address} (order {header.order_id}) was overwritten while copied"
                    )
                )
                return
            labels = np.fromiter(header.labels, np.int64, header.count)  # (asarray of a repeated field: 2-3x slower)
            batch.labels[where] = self.space.global_labels(order.shard, labels)
            if targets is not None:
                self._keep_targets(batch, order.shard, rows, targets)
            order.nbytes += len(pixels)
            for e in header.errors:
                if header.start <= e.position < header.start + header.count:
                    row = order.positions[e.position]
                    order.failures.append(SampleFailure(int(batch.ids[row]), e.key, e.reason, link.address))
        elif shared is not None:  # (another server's twin won: nothing to copy)
            link.release(shared)
        order.received += header.count
        if order.received == order.samples:
            link.complete(order)
            twin = order.twin
            if twin is not None and not order.cancelled:  # it won: the twin is dropped
                twin.cancelled = True
                there = self.links.get(twin.sent_to)
                if there is not None:
                    there.cancel(twin)
            if not order.cancelled:
                # Only now: a server that failed half-way must not leave its reports behind.
                self._credit(order, order.samples - order.credited)
            self._pump()

    def _copy(self, batch: Batch, shard: ShardInfo, where: slice | np.ndarray, pixels: memoryview) -> None:
        """A raw chunk's pixels (and masks) into its rows (``where``: a slice of consecutive
        rows, one copy; or their indices)."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        h, w = self.setup.height, self.setup.width
        count = where.stop - where.start if isinstance(where, slice) else len(where)
        images = count * limits.sample_bytes(h, w)
        batch.pixels[where] = np.frombuffer(pixels[:images], dtype=np.uint8).reshape(count, h, w, limits.CHANNELS)
        if batch.masks is not None:
            masks = np.frombuffer(pixels[images:], dtype=np.uint8).reshape(count, h, w)
            if isinstance(where, slice):
                place = batch.masks[where]
                place[...] = masks
                self.space.global_masks(shard, place)
            else:
                masks = masks.copy()
                self.space.global_masks(shard, masks)
                batch.masks[where] = masks

    def _decode(
        self, batch: Batch, shard: ShardInfo, rows: np.ndarray, pixels: memoryview, parts: list[tuple[int, int]]
    ) -> None:
        """An encoded chunk's parts (protos.wire), each decoded straight into its row; ValueError
        for a part that does not decode to exactly its row."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        count = len(rows)
        for i, row in enumerate(rows.tolist()):
            offset, size = parts[i]
            wire.decode_part(self.setup.wire, pixels[offset : offset + size], batch.pixels[row], mask=False)
            if batch.masks is not None:
                offset, size = parts[count + i]
                wire.decode_part(self.setup.wire, pixels[offset : offset + size], batch.masks[row], mask=True)
                self.space.global_masks(shard, batch.masks[row : row + 1])

    def _credit(self, order: _Order, count: int) -> None:
        """``count`` more of ``order``'s samples are in their batch, with the reports so far."""
        batch = order.batch
        batch.failures.extend(order.failures)
        batch.nbytes += order.nbytes
        order.failures, order.nbytes = [], 0
        batch.remaining -= count
        if batch.remaining == 0 and self._run is not None:
            self._run.complete(batch, self.options.ordered)

    def _keep_targets(
        self, batch: Batch, shard: ShardInfo, rows: np.ndarray, targets: list[dict[str, np.ndarray]]
    ) -> None:
        """Keeps each row's targets, class labels remapped onto the loader's class list."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        for row, arrays in zip(rows.tolist(), targets):
            for name, column in batch.targets.items():
                value = arrays.get(name)
                if value is not None and name in tg.LABELLED:
                    value = self.space.global_labels(shard, value.astype(np.int64, copy=False))
                column[row] = value

    # ---- failures (LinkEvents) ------------------------------------------------------
    def on_link_down(self, link: Link[_Order], orders: list[_Order], exc: BaseException) -> None:
        """A server failed: its unfinished orders go back to the front of the queue (those with a
        twin still in flight elsewhere are left to the twin)."""
        requeued = []
        for order in orders:
            twin = order.twin
            if twin is not None and not twin.cancelled and any(twin is o for o in self._in_flight(twin)):
                order.cancelled = True
                twin.twin = None  # on its own again (it may be hedged anew)
            else:
                order.twin = None
                if order.credited:  # hedged, and its twin is gone too: only its rest is still missing
                    order.positions, order.local = order.positions[order.credited :], order.local[order.credited :]
                    order.credited = 0
                requeued.append(order)
        orders = requeued
        self._pending[:0] = sorted(orders, key=lambda o: o.order_id)
        if link.state is LinkState.DEAD:
            log.error("loader server %s refused this client: %s", link.address, describe_error(exc))
        elif orders:
            others = {
                a
                for o in orders
                for a in o.shard.owners
                if a != link.address and a in self.links and self.links[a].state is LinkState.UP
            }
            log.warning(
                "loader server %s failed (%s); %d order(s) go back to the queue, %s; "
                "reconnecting to it for up to %.0fs",
                link.address,
                describe_error(exc),
                len(orders),
                f"for {', '.join(sorted(others))}"
                if others
                else "which waits for it: no other server holds its shards",
                link.retry_left(),
            )
        else:  # e.g. drained while this loader had nothing in flight there
            log.info("loader server %s went away (%s); it held no orders", link.address, describe_error(exc))
        self._pump()

    def _in_flight(self, order: _Order) -> list[_Order]:
        """The orders in flight on the servers that are up and own ``order``'s shard."""
        links = (self.links.get(a) for a in order.shard.owners)
        return [o for link in links if link is not None and link.state is LinkState.UP for o in link.orders()]

    def on_link_up(self, link: Link[_Order]) -> None:
        self._pump()

    def on_link_lost(self, link: Link[_Order]) -> None:
        self._check_stranded()

    def _check_stranded(self) -> None:
        """Fails the epoch when pending work has no owner that is up or coming back."""
        if not self._pending:
            return
        hopeful = {a for a, link in self.links.items() if link.hopeful}
        for order in self._pending:
            if not any(owner in hopeful for owner in order.shard.owners):
                owners = [self.links[o] for o in order.shard.owners if o in self.links]
                detail = "; ".join(
                    f"{link.address}: {link.gave_up or link.last_error or link.state.value}" for link in owners
                )
                ids = order.batch.ids[order.positions]
                self.fail(
                    LoaderError(
                        f"no loader server can serve shard {order.shard.name} ({order.shard.id}): {detail}; "
                        f"{len(ids)} sample(s) of batch {order.batch.seq} could not be served, ids "
                        f"{_abbrev(ids.tolist())}"
                    )
                )
                return

    async def _watch_progress(self) -> None:
        """Fails a server that holds orders but sent nothing for progress_timeout (it is stuck)."""
        timeout = self.options.progress_timeout
        while True:
            await asyncio.sleep(min(2.0, timeout / 4))
            for link in list(self.links.values()):
                link.check_progress(timeout)

    def fail(self, error: BaseException) -> None:
        """Ends the running epoch with ``error``: the consumer takes what is ready, then the error."""
        run = self._run
        if run is not None and not run.cancelled:
            self.cancel_epoch(drain=False)
            run.out.put(error)

    def close(self) -> None:
        """Drops the running epoch and stops the progress watchdog (the receiver closes the links)."""
        self.cancel_epoch()
        if self._watchdog is not None:
            self._watchdog.cancel()


class _Run:
    """One epoch's batches from ``first_seq`` on, less ``skip`` (already delivered before a resume):
    what is dispatched, what is ready, and the order batches go out in."""

    def __init__(
        self,
        token: int,
        epoch: int,
        batches: list[np.ndarray],
        first_seq: int,
        out: queue.Queue[Item],
        skip: frozenset[int] = frozenset(),
    ):
        self.token = token
        self.epoch = epoch
        self.batches = batches
        self.skip = frozenset(s for s in skip if first_seq <= s < len(batches))
        self.expected = len(batches) - first_seq - len(self.skip)
        sizes = np.asarray([0 if i in self.skip else len(b) for i, b in enumerate(batches)], np.int64)
        self._after = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0]])  # samples in batches[i:]
        self.next_dispatch = first_seq
        self.next_deliver = first_seq
        self.dispatched = 0
        self.consumed = 0
        self.delivered = 0
        self.ready: dict[int, Batch] = {}
        self.open: dict[int, Batch] = {}  # dispatched, not yet handed out
        self.out = out
        self.cancelled = False

    def samples_after(self, seq: int) -> int:
        """Samples of the batches from ``seq`` on (less those skipped)."""
        return int(self._after[min(seq, len(self._after) - 1)])

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
