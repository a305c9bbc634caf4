"""Reassembly: batches put together from the chunks of their orders, and handed out in turn.

A plan batch gets its buffer from the consumer's side (``BatchBuffers``) when it is dispatched
and is split by owner group (the servers that hold its samples' shards) into ``Order``s, each
what a server is asked for in one message. Every
checked chunk (``chunks.py``) is placed straight into its rows (``Assembler.place``): pixels and
masks copied once (or decoded, on an encoded wire), labels and targets remapped onto the
loader's classes (``sample_space.py``). An order's samples count into its batch only when the
order completes (``EpochRun.credit``): a server that failed half-way leaves nothing behind, and
its order is sent again whole. ``EpochRun`` hands the complete batches out in plan order
(or as they complete) on the epoch's queue, then END.

Scheduling (which server gets an order, when, and what happens on failure) is the engine's.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from remoteloader.client.batches import END, Batch, Item, SampleFailure
from remoteloader.client.chunks import Checked, StreamShape
from remoteloader.client.sample_space import SampleSpace
from remoteloader.protos import limits, loader_pb2, wire
from remoteloader.protos import targets as tg

if TYPE_CHECKING:
    import torch

    from remoteloader.client.epoch import Pass


class BatchBuffers(Protocol):
    """Where batches are received: memory the consumer's side lends, one buffer per batch."""

    def allocate(self, n: int, h: int, w: int) -> torch.Tensor | np.ndarray | None:
        """A uint8 (n, h, w, 3) buffer, or None when none is free (the listener hears when one is)."""

    def masks_for(self, images: Any, n: int, h: int, w: int) -> np.ndarray:
        """A uint8 (n, h, w) array for the masks of the batch received into ``images`` (in the
        same lent memory where the buffers have room for masks)."""

    def release(self, images: Any) -> None:
        """Takes back the buffer of a batch dropped before it was handed out."""

    def listen(self, freed: Callable[[], None]) -> None:
        """Calls ``freed`` (from any thread; it must not block) whenever a buffer comes back, so
        that dispatch goes on where ``allocate`` found none (the receiver listens)."""


class PlannedBatches(Protocol):
    """An epoch's batches of sample ids as the plan gives them (``plan.Batches``): each computed
    when asked for, and their sizes known without computing them."""

    def __len__(self) -> int: ...

    def __getitem__(self, k: int) -> np.ndarray: ...

    def size(self, k: int) -> int:
        """The number of ids in batch ``k``."""

    def samples_from(self, k: int) -> int:
        """The number of ids in batches ``k`` to the last (0 past the end)."""


@dataclass
class Order:
    """A part of one batch for one owner group (shards the same servers hold): what a server is
    asked for in one message."""

    order_id: int
    batch: Batch
    owners: tuple[str, ...]  # the servers that hold all its samples
    positions: np.ndarray  # rows of the batch
    shards: np.ndarray  # each sample's shard (an index into the sample space's shards)
    local: np.ndarray  # each sample's index in its shard
    epoch: int
    received: int = 0
    cancelled: bool = False
    failures: list[SampleFailure] = field(default_factory=list)  # merged into the batch when the order completes
    nbytes: int = 0
    twin: Order | None = None  # its rest sent to another server too (engine's hedging); the first to complete wins
    credited: int = 0  # its first samples already counted into the batch (when it was hedged)
    sent_to: str = ""  # the server it was last sent to

    @property
    def samples(self) -> int:
        return len(self.positions)

    def sent(self, server: str) -> None:
        """It goes (again) to ``server``: what an earlier sending received counts for nothing."""
        self.sent_to = server
        self.received = 0
        self.failures = []
        self.nbytes = 0

    def split(self, count: int, order_id: int) -> Order:
        """Takes the first ``count`` samples out as an order of their own (this one keeps the rest)."""
        head = self._part(order_id, slice(None, count))
        self.drop_first(count)
        return head

    def rest(self, order_id: int) -> Order:
        """An order for the samples of this one not received yet (its twin, when hedged)."""
        return self._part(order_id, slice(self.received, None))

    def drop_first(self, count: int) -> None:
        """Forgets its first ``count`` samples (already in their batch)."""
        self.positions, self.shards, self.local = self.positions[count:], self.shards[count:], self.local[count:]

    def cancel(self) -> None:
        """The engine no longer wants it: what still arrives of it is dropped, and a failure of
        its server does not hand it back."""
        self.cancelled = True

    def arrived(self, count: int) -> bool:
        """``count`` more of its samples arrived; returns whether all of them have."""
        self.received += count
        return self.received == self.samples

    def hedge(self, order_id: int) -> Order:
        """Its rest as a twin for another server (whichever completes first fills the batch);
        what arrived of it so far stays credited to the batch (``credited``)."""
        self.credited = self.received
        twin = self.rest(order_id)
        twin.twin, self.twin = self, twin
        return twin

    def unhedge(self) -> None:
        """Its twin is gone: it is on its own again (and may be hedged anew)."""
        self.twin = None

    def requeue(self) -> None:
        """Its server failed and no twin carries it on: it goes back to the queue, less what its
        batch already holds of it (its first ``credited`` samples, when it was hedged)."""
        self.twin = None
        if self.credited:
            self.drop_first(self.credited)
            self.credited = 0

    def _part(self, order_id: int, part: slice) -> Order:
        return Order(
            order_id, self.batch, self.owners, self.positions[part], self.shards[part], self.local[part], self.epoch
        )


class Assembler:
    """Allocates batches and places checked chunks into their rows; on the I/O loop thread.

    Args:
        setup: The stream's Setup (output size, the fields asked for, the wire).
        buffers: The consumer's lent memory: the only owner of batch buffers.
    """

    def __init__(self, setup: loader_pb2.Setup, buffers: BatchBuffers):
        self.shape = StreamShape.of(setup)
        self.buffers = buffers
        self.fields = tuple(f for f in setup.fields if f != tg.MASK)  # the targets kept per row
        self.space: SampleSpace | None = None  # the running epoch's

    def new_batch(self, seq: int, ids: np.ndarray) -> Batch | None:
        """Batch ``seq`` in a lent buffer, or None when every buffer is in use."""
        h, w = self.shape.height, self.shape.width
        images = self.buffers.allocate(len(ids), h, w)
        if images is None:
            return None
        pixels = images if isinstance(images, np.ndarray) else images.numpy()
        batch = Batch(seq, ids, images, pixels, np.full(len(ids), -1, np.int64), len(ids))
        if self.shape.masks:
            batch.masks = self.buffers.masks_for(images, len(ids), h, w)
        batch.targets = {name: [None] * len(ids) for name in self.fields}
        return batch

    def release(self, batch: Batch) -> None:
        """Gives a batch's buffer back (a batch dropped before the consumer took it)."""
        self.buffers.release(batch.images)

    def place(
        self, order: Order, header: loader_pb2.ChunkHeader, payload: memoryview, checked: Checked, server: str
    ) -> None:
        """Puts a checked chunk's samples into their rows of ``order``'s batch, with their labels,
        targets and failures (those count into the batch when the order completes); ValueError
        for an encoded part that does not decode to exactly its row."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        batch = order.batch
        part = slice(header.start, header.start + header.count)
        rows, shards = order.positions[part], order.shards[part]
        first = int(rows[0])
        # where the rows are in the batch's arrays: a slice when they are consecutive (the usual case)
        where = slice(first, first + len(rows)) if rows[-1] - first == len(rows) - 1 else rows
        if checked.parts is None:
            self._copy(batch, shards, where, payload)
        else:
            self._decode(batch, shards, rows, payload, checked.parts)
        labels = np.fromiter(header.labels, np.int64, header.count)  # (asarray of a repeated field: 2-3x slower)
        batch.labels[where] = self.space.global_labels(shards, labels)
        if checked.targets is not None:
            self._keep_targets(batch, shards, rows, checked.targets)
        order.nbytes += len(payload)
        for e in header.errors:
            if header.start <= e.position < header.start + header.count:
                row = order.positions[e.position]
                order.failures.append(SampleFailure(int(batch.ids[row]), e.key, e.reason, server))

    def _copy(self, batch: Batch, shards: np.ndarray, where: slice | np.ndarray, payload: memoryview) -> None:
        """A raw chunk's pixels (and masks) into its rows (``where``: a slice of consecutive
        rows, one copy; or their indices), the samples being of ``shards``."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        h, w = self.shape.height, self.shape.width
        count = where.stop - where.start if isinstance(where, slice) else len(where)
        images = count * limits.sample_bytes(h, w)
        batch.pixels[where] = np.frombuffer(payload[:images], dtype=np.uint8).reshape(count, h, w, limits.CHANNELS)
        if batch.masks is not None:
            masks = np.frombuffer(payload[images:], dtype=np.uint8).reshape(count, h, w)
            if isinstance(where, slice):
                place = batch.masks[where]
                place[...] = masks
                self._global_masks(shards, place)
            else:
                masks = masks.copy()
                self._global_masks(shards, masks)
                batch.masks[where] = masks

    def _global_masks(self, shards: np.ndarray, masks: np.ndarray) -> None:
        """Remaps each mask, of the sample of ``shards`` in its place, onto the loader's classes."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        if not self.space.remapped:
            return
        for k in np.unique(shards).tolist():
            mine = np.flatnonzero(shards == k)
            if len(mine) == len(shards):
                self.space.global_masks(k, masks)
            else:
                some = masks[mine]
                self.space.global_masks(k, some)
                masks[mine] = some

    def _decode(
        self, batch: Batch, shards: np.ndarray, rows: np.ndarray, payload: memoryview, parts: list[tuple[int, int]]
    ) -> None:
        """An encoded chunk's parts (protos.wire), each decoded straight into its row."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        count = len(rows)
        for i, row in enumerate(rows.tolist()):
            offset, size = parts[i]
            wire.decode_part(self.shape.wire, payload[offset : offset + size], batch.pixels[row], mask=False)
            if batch.masks is not None:
                offset, size = parts[count + i]
                wire.decode_part(self.shape.wire, payload[offset : offset + size], batch.masks[row], mask=True)
                self.space.global_masks(int(shards[i]), batch.masks[row : row + 1])

    def _keep_targets(
        self, batch: Batch, shards: np.ndarray, rows: np.ndarray, targets: list[dict[str, np.ndarray]]
    ) -> None:
        """Keeps each row's targets, class labels remapped onto the loader's class list."""
        assert self.space is not None, "orders are only sent while an epoch runs"
        for row, shard, arrays in zip(rows.tolist(), shards.tolist(), targets):
            for name, column in batch.targets.items():
                value = arrays.get(name)
                if value is not None and name in tg.LABELLED:
                    values = value.astype(np.int64, copy=False)
                    value = self.space.global_labels(np.full(values.shape, shard), values)
                column[row] = value


class EpochRun:
    """The pass ``played`` (``epoch.Pass``): its plan's batches from its ``start`` on, less its
    ``done`` (delivered before a resume); what is dispatched, what is ready, and the order
    batches go out in (``ordered``: the plan's). The consumer's side names the pass with each
    ``consumed``, so that a late call about an abandoned pass changes nothing. Only its own
    methods change it."""

    def __init__(self, played: Pass, out: queue.Queue[Item], ordered: bool = True):
        self.played = played
        self.epoch = played.epoch
        batches: PlannedBatches = played.plan.batches
        first_seq, skip = played.start, played.done
        self.batches = batches  # computed as they are dispatched
        self.ordered = ordered
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
        if self.expected == 0:
            out.put(END)

    def cancel(self, drain: bool = True) -> list[Batch]:
        """The pass was abandoned: nothing more goes out. Returns the batches whose buffers are
        free again: those dispatched and not handed out, and (``drain``) those handed out that
        the consumer never took."""
        self.cancelled = True
        freed = list(self.open.values())
        self.open.clear()
        while drain:
            try:
                item = self.out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Batch):
                freed.append(item)
        return freed

    def failed(self, error: BaseException) -> None:
        """Ends the pass with ``error``: the consumer takes what is ready, then the error."""
        self.out.put(error)

    def took_one(self) -> None:
        """The consumer took one of its batches: one more may be dispatched."""
        self.consumed += 1

    def samples_after(self, seq: int) -> int:
        """Samples of the batches from ``seq`` on (less those skipped), without computing them."""
        return self.batches.samples_from(seq) - sum(self.batches.size(s) for s in self.skip if s >= seq)

    def next_batch(self, in_flight: int) -> int | None:
        """The seq of the next batch to dispatch, with ``in_flight`` batches allowed ahead of the
        consumer; None when the plan is done or that many are out."""
        while self.next_dispatch in self.skip:
            self.next_dispatch += 1
        if self.next_dispatch >= len(self.batches) or self.dispatched - self.consumed >= in_flight:
            return None
        return self.next_dispatch

    def dispatched_batch(self, batch: Batch) -> None:
        """``batch`` (the one ``next_batch`` named) got its buffer and is split into orders."""
        self.next_dispatch += 1
        self.dispatched += 1
        self.open[batch.seq] = batch

    def credit(self, order: Order, count: int) -> None:
        """``count`` more of ``order``'s samples are in their batch, with its reports so far."""
        batch = order.batch
        batch.failures.extend(order.failures)
        batch.nbytes += order.nbytes
        order.failures, order.nbytes = [], 0
        batch.remaining -= count
        if batch.remaining == 0:
            self._complete(batch)

    def _complete(self, batch: Batch) -> None:
        if self.cancelled:
            return
        if not self.ordered:
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
