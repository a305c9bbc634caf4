"""Scheduling, on the client's I/O event loop: which server gets which order, and when.

Each batch of the plan is split into orders by owner group (``sample_space.py``: the shards the
same servers hold), so that a batch is at most one order per server however many shards it
touches (more only where ``max_order_samples`` or a slow server's share splits it). Orders
wait in one FIFO and each goes to the live owner that is expected to finish it first (by the
samples it holds and its measured rate), at most ``max_inflight`` per server (credits: the
memory bound). Each chunk that arrives is checked (``chunks.py``) and placed into its rows
(``assembly.py``, which also hands complete batches out in turn). When a server fails,
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
go, and the assembler (``assembly.py``) puts batches together.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue

import numpy as np

from remoteloader.client import chunks
from remoteloader.client.assembly import Assembler, BatchBuffers, EpochRun, Order
from remoteloader.client.batches import END, Batch, Item, LoaderError, SampleFailure
from remoteloader.client.epoch import Pass
from remoteloader.client.link import Arrival, Link, LinkState, describe_error
from remoteloader.client.option_groups import FlowOptions
from remoteloader.protos import loader_pb2

__all__ = ["END", "Batch", "BatchBuffers", "Engine", "LoaderError", "Order", "SampleFailure"]

log = logging.getLogger("remoteloader.client")

MIN_SPLIT = 16  # fewest samples an order is split off into, for a slower server to finish in time
SAFETY = 0.8  # the share of the time to an order's deadline a slower server is given work for
SLOW = 3  # a server this many times slower than the fastest holds one order at a time


class Engine:
    """Runs one epoch at a time over the receiver's links; lives on the I/O loop thread.

    Args:
        links: The receiver's links by address. The receiver owns them: it adds, drops and
            closes them; the engine opens their streams, sends orders and reads their state.
        setup: The stream's Setup message (output size, fields, wire).
        flow: Prefetch, ordering and the progress timeout (RemoteLoader's FlowOptions).
        buffers: Where batches are received (the assembler's).
        seed: The loader's seed, which every order carries (each sample's augmentation).
    """

    def __init__(
        self,
        links: dict[str, Link[Order]],
        setup: loader_pb2.Setup,
        flow: FlowOptions,
        buffers: BatchBuffers,
        seed: int,
    ):
        self.links = links
        self.setup = setup
        self.flow = flow
        self.seed = seed
        self.assembler = Assembler(setup, buffers)
        self.out: queue.Queue[Item] = queue.Queue()
        self.order_size = 1
        self._order_ids = itertools.count(1)
        self._pending: list[Order] = []  # FIFO: failed orders go back to its front
        self._run: EpochRun | None = None
        self._watchdog: asyncio.Task | None = None

    # ---- epochs ---------------------------------------------------------------------
    async def start_epoch(self, played: Pass) -> None:
        """Starts the pass ``played`` (from its ``start``, less its ``done``, over its ``space``)."""
        self.cancel_epoch()
        self.assembler.space = played.space
        self.order_size = min(link.describe.max_order_samples for link in self.links.values() if link.describe)
        for link in self.links.values():
            if link.state is LinkState.NEW:
                await link.open_stream(self.setup)
            else:
                link.revive()  # given up on (or refused) earlier: it gets another reconnect_timeout
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch_progress())
        self.out = queue.Queue()
        self._run = run = EpochRun(played, self.out, self.flow.ordered)
        if run.expected:
            self._dispatch(run)

    @property
    def playing(self) -> Pass | None:
        """The pass running (read from the consumer thread)."""
        run = self._run
        return run.played if run is not None else None

    def cancel_epoch(self, played: Pass | None = None, drain: bool = True) -> None:
        """Abandons the current pass, if ``played`` is still it; in-flight work is dropped."""
        run = self._run
        if run is None or (played is not None and run.played is not played):
            return
        for batch in run.cancel(drain):  # never handed out, or never taken: their buffers are free again
            self.assembler.release(batch)
        for order in self._pending:
            order.cancel()
        self._pending.clear()
        for link in self.links.values():
            for order in link.orders():
                order.cancel()
        self._run = None

    def consumed(self, played: Pass) -> None:
        """The consumer took a batch of the pass ``played``: one more may be requested."""
        run = self._run
        if run is not None and run.played is played:
            run.took_one()
            self._dispatch(run)

    def buffer_freed(self) -> None:
        """A buffer came back: dispatching may go on where ``allocate`` found none."""
        if self._run is not None and not self._run.cancelled:
            self._dispatch(self._run)

    def _dispatch(self, run: EpochRun) -> None:
        """Turns plan batches into orders, up to ``prefetch`` batches ahead of the consumer."""
        space = self.assembler.space
        assert space is not None, "an epoch runs over a sample space"
        while True:
            seq = run.next_batch(self.flow.prefetch)
            if seq is None:
                break
            ids = run.batches[seq]
            batch = self.assembler.new_batch(seq, ids)
            if batch is None:  # every buffer is in use: resume when one comes back
                break
            run.dispatched_batch(batch)
            shards = space.shard_of(ids)
            local = ids - space.offsets(shards)
            groups = space.group_of[shards]
            for g in np.unique(groups).tolist():
                positions = np.flatnonzero(groups == g) if len(space.groups) > 1 else np.arange(len(ids))
                owners = space.groups[g].owners
                for start in range(0, len(positions), self.order_size):
                    rows = positions[start : start + self.order_size]
                    order = Order(next(self._order_ids), batch, owners, rows, shards[rows], local[rows], run.epoch)
                    self._pending.append(order)
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
                for link in (self.links.get(a) for a in order.owners)
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
                order = order.split(room, next(self._order_ids))
            else:
                self._pending.remove(order)
            self._send(best, order)
        self._hedge()
        self._check_stranded()

    @staticmethod
    def _credits(link: Link[Order], fastest: float) -> int:
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

    def _deadline(self, order: Order, pace: float) -> float:
        """Seconds until the training loop wants ``order``'s batch: the samples it takes first
        (those of the batches before it; with ordered=False, the rest of the epoch) over ``pace``."""
        run = self._run
        if run is None:
            return 0.0
        if not self.flow.ordered:
            left = run.samples_after(run.next_dispatch) + sum(o.samples for o in self._pending)
            return (left + sum(link.outstanding for link in self.links.values())) / pace
        return (run.samples_after(run.next_deliver) - run.samples_after(order.batch.seq)) / pace

    def _hedge(self) -> None:
        """Sends each server that has nothing in flight, when no order is pending, a twin of the
        rest of the oldest order a slower replica holds that will be late (the loop would wait
        for it) and that it would finish sooner (by more than half again): a slow server's
        estimate gone wrong, or a server slowed down, does not hold up the batches behind it."""
        run = self._run
        if self._pending or run is None:
            return
        up = [link for link in self.links.values() if link.state is LinkState.UP]
        default_rate = max((link.rate for link in up if link.rate), default=1000.0)
        pace = self._pace()
        for link in up:
            if link.outstanding or link.credits <= 0:
                continue
            oldest: Order | None = None
            for other in up:
                if other is link:
                    continue
                ahead = 0  # samples the other server sends before this order's last one
                for order in other.orders():
                    ahead += order.samples - order.received
                    if order.cancelled or order.twin is not None or link.address not in order.owners:
                        continue
                    there = ahead / (other.rate or default_rate)
                    late = there > self._deadline(order, pace)  # the loop would wait for it
                    if late and there > 1.5 * order.samples / (link.rate or default_rate):
                        if oldest is None or order.order_id < oldest.order_id:
                            oldest = order
                        break
            if oldest is not None:
                # What arrived of it stays; the twin is the rest.
                run.credit(oldest, oldest.received - oldest.credited)
                self._send(link, oldest.hedge(next(self._order_ids)))

    def _send(self, link: Link[Order], order: Order) -> None:
        order.sent(link.address)
        space = self.assembler.space
        assert space is not None, "orders are only sent while an epoch runs"
        named, which = np.unique(order.shards, return_inverse=True)
        link.send(
            order,
            loader_pb2.Order(
                order_id=order.order_id,
                shard_ids=[space.shards[k].id for k in named.tolist()],
                shards=which.tolist() if len(named) > 1 else (),
                indices=order.local.tolist(),
                seed=self.seed,
                epoch=order.epoch,
            ),
        )

    # ---- receiving (LinkEvents) -----------------------------------------------------
    def on_chunk(self, link: Link[Order], arrival: Arrival[Order]) -> None:
        """Checks a chunk its link resolved (``chunks.py``) and places it into its batch's rows
        (``assembly.py``); completes orders and batches. A chunk that does not fit fails its
        server's link."""
        header, payload, order = arrival.header, arrival.payload, arrival.order
        try:
            checked = chunks.check(
                header,
                len(payload),
                order,
                self.assembler.shape,
                link.address,
                read_targets=order is not None and not order.cancelled,
            )
        except chunks.BadChunk as exc:
            link.fail(ConnectionError(str(exc)))
            return
        assert order is not None, "check refuses a chunk of no order"
        if not order.cancelled:
            try:
                self.assembler.place(order, header, payload, checked, link.address)
            except ValueError as exc:  # an encoded part that does not decode to its row
                link.fail(
                    ConnectionError(
                        f"bad {self.setup.wire} chunk from {link.address} (order {header.order_id}, "
                        f"start {header.start}): {exc}"
                    )
                )
                return
            if not arrival.release():
                link.fail(
                    ConnectionError(
                        f"shared chunk from {link.address} (order {header.order_id}) was overwritten while copied"
                    )
                )
                return
        else:  # (another server's twin won: nothing to copy)
            arrival.release()
        if order.arrived(header.count):
            self._complete(link, order)

    def _complete(self, link: Link[Order], order: Order) -> None:
        """All of ``order`` arrived from ``link``: its twin (if hedged) is dropped, and only now do its
        samples count into the batch (a server that failed half-way must not leave its reports behind)."""
        link.complete(order)
        if not order.cancelled:
            twin = order.twin
            if twin is not None:  # it won: the twin is dropped
                twin.cancel()
                there = self.links.get(twin.sent_to)
                if there is not None:
                    there.cancel(twin)
            run = self._run
            if run is not None:
                run.credit(order, order.samples - order.credited)
        self._pump()

    # ---- failures (LinkEvents) ------------------------------------------------------
    def on_link_down(self, link: Link[Order], orders: list[Order], exc: BaseException) -> None:
        """A server failed: its unfinished orders go back to the front of the queue (those with a
        twin still in flight elsewhere are left to the twin)."""
        requeued = []
        for order in orders:
            twin = order.twin
            if twin is not None and not twin.cancelled and any(twin is o for o in self._in_flight(twin)):
                order.cancel()
                twin.unhedge()
            else:
                order.requeue()
                requeued.append(order)
        orders = requeued
        self._pending[:0] = sorted(orders, key=lambda o: o.order_id)
        if link.state is LinkState.DEAD:
            log.error("loader server %s refused this client: %s", link.address, describe_error(exc))
        elif orders:
            others = {
                a
                for o in orders
                for a in o.owners
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

    def _in_flight(self, order: Order) -> list[Order]:
        """The orders in flight on the servers that are up and own ``order``'s shards."""
        links = (self.links.get(a) for a in order.owners)
        return [o for link in links if link is not None and link.state is LinkState.UP for o in link.orders()]

    def on_link_up(self, link: Link[Order]) -> None:
        self._pump()

    def on_link_lost(self, link: Link[Order]) -> None:
        self._check_stranded()

    def _check_stranded(self) -> None:
        """Fails the epoch when pending work has no owner that is up or coming back."""
        if not self._pending:
            return
        hopeful = {a for a, link in self.links.items() if link.hopeful}
        for order in self._pending:
            if not any(owner in hopeful for owner in order.owners):
                owners = [self.links[o] for o in order.owners if o in self.links]
                detail = "; ".join(
                    f"{link.address}: {link.gave_up or link.last_error or link.state.value}" for link in owners
                )
                ids = order.batch.ids[order.positions]
                space = self.assembler.space
                assert space is not None, "orders are only pending while an epoch runs"
                named = [f"{space.shards[k].name} ({space.shards[k].id})" for k in np.unique(order.shards).tolist()]
                shards = f"shard {named[0]}" if len(named) == 1 else f"shards {', '.join(named[:5])}"
                shards += f"... ({len(named)} in all)" if len(named) > 5 else ""
                self.fail(
                    LoaderError(
                        f"no loader server can serve {shards}: {detail}; "
                        f"{len(ids)} sample(s) of batch {order.batch.seq} could not be served, ids "
                        f"{_abbrev(ids.tolist())}"
                    )
                )
                return

    async def _watch_progress(self) -> None:
        """Fails a server that holds orders but sent nothing for progress_timeout (it is stuck)."""
        timeout = self.flow.progress_timeout
        while True:
            await asyncio.sleep(min(2.0, timeout / 4))
            for link in list(self.links.values()):
                link.check_progress(timeout)

    def fail(self, error: BaseException) -> None:
        """Ends the running epoch with ``error``: the consumer takes what is ready, then the error."""
        run = self._run
        if run is not None and not run.cancelled:
            self.cancel_epoch(drain=False)
            run.failed(error)

    def close(self) -> None:
        """Drops the running epoch and stops the progress watchdog (the receiver closes the links)."""
        self.cancel_epoch()
        if self._watchdog is not None:
            self._watchdog.cancel()


def _abbrev(items: list, limit: int = 20) -> str:
    return str(items) if len(items) <= limit else f"{items[:limit]}... ({len(items)} in all)"
