"""One rendering for every stream that asks for the same chunk: concurrent jobs share the decode.

A chunk's pixels, targets and errors are a function of its ``ChunkKey``: the stream's
pipeline spec (preset or albumentations JSON, size, fields, wire), the order's seed and
epoch, and the chunk's samples, each one's shard and index (server.seeds derives every random
draw from these). Two streams that would render the same key (two jobs of a sweep over one plan, say)
get one rendering, written into one slot, and each writes its own chunk from it: same
order ids as each asked, same exactly-once bookkeeping on each client. Sharing is found,
never assumed: chunks that differ in any part of the key render apart, as do streams whose
Setup says ``exclusive`` and the transport benchmark's synthetic shards.

Invariants:
* A rendering can be joined while it renders and, once every sample of it rendered cleanly,
  for as long as its slot stays out of the arena: while any stream holds it, and after,
  while the slot is kept. One with a failed sample is not joined once done (a transient
  failure is tried again). A stream that comes later renders its own.
* A kept rendering's whole life is here: when the last stream gives back the slot of a clean
  rendering that can still be joined, the slot is kept (held for no stream: slots.hold),
  but only while no take waits for a slot; a take that finds no slot free first lets the
  oldest kept one go back to the arena; a stream that joins a kept one holds it again. So
  keeping never makes a stream wait. Every stream gives its chunks' slots back here
  (``give``, ``give_when_done``: the order stream, and local_socket.Loans for lent ones).
* Each sharer holds the slot within its own fair share, and gives it back as it would its
  own; a sharer that ends, is slow, or stops reading holds only its own share (the stall
  rules end it), so none of them holds the others back by more than that.
* The stream that starts a rendering is charged for it (its job's place in the decode
  queue, server.fair_queue); the others pay nothing, and wait for it at that place: a
  heavier job that joins a lighter one's rendering gets it when the lighter one would.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from remoteloader.server.order_samples import Samples
from remoteloader.server.pipelines import PipelineSpec
from remoteloader.server.slots import Slots, StreamSlots
from remoteloader.server.worker_pool import Rendered


class ChunkKey(NamedTuple):
    """What a chunk's rendering depends on, and all it depends on."""

    spec: PipelineSpec
    shards: tuple[str, ...]  # each sample's shard id
    seed: int
    epoch: int
    indices: bytes  # each sample's index in its shard, int64

    @classmethod
    def of(cls, spec: PipelineSpec, samples: Samples, seed: int, epoch: int) -> ChunkKey:
        return cls(spec, samples.shard_ids(), seed, epoch, np.ascontiguousarray(samples.indices, np.int64).tobytes())


class Started(NamedTuple):
    """A chunk a stream holds: its slot, the rendering's future, and whether another stream started it."""

    slot: int
    future: asyncio.Future[Rendered]
    joined: bool


class SharedRenders:
    """The renderings streams may join, by key; the one place a stream gets a chunk's slot, and
    gives it back.

    A rendering is known by its key with its slot and that slot's generation when it started:
    it can be joined while the slot still has that generation (a slot that went back to the
    arena has a new one), so no one needs to tell this class when a slot goes back.

    Args:
        slots: The arena's slots, which hand out, take back and hold the kept ones.
    """

    def __init__(self, slots: Slots):
        self._slots = slots
        self._arena = slots.arena
        self._by_key: dict[ChunkKey, tuple[int, int, asyncio.Future[Rendered]]] = {}  # (slot, generation, future)
        self._key_at: dict[int, ChunkKey] = {}  # slot -> the key it was last rendered for (at most one a slot)
        self._kept: OrderedDict[int, None] = OrderedDict()  # slots held by no stream, kept: oldest first

    def __len__(self) -> int:
        """Renderings that can be joined now."""
        return sum(self._current(key) is not None for key in list(self._by_key))

    @property
    def kept(self) -> int:
        """Slots held by no stream, kept for a later sharer."""
        return len(self._kept)

    def has(self, key: ChunkKey | None) -> bool:
        """Whether a rendering of ``key`` can be joined now."""
        return key is not None and self._current(key) is not None

    def _current(self, key: ChunkKey) -> tuple[int, asyncio.Future[Rendered]] | None:
        """The rendering of ``key`` that can be joined now (its slot and future), else None (one
        whose slot went back is forgotten here)."""
        found = self._by_key.get(key)
        if found is None:
            return None
        slot, generation, future = found
        if self._arena.generation(slot) != generation:
            self._drop(key)
            return None
        return slot, future

    def _drop(self, key: ChunkKey) -> None:
        slot = self._by_key.pop(key)[0]
        if self._key_at.get(slot) == key:
            del self._key_at[slot]

    async def start(
        self,
        stream: StreamSlots,
        key: ChunkKey | None,
        render: Callable[[int], asyncio.Future[Rendered]],
    ) -> Started:
        """The chunk ``key`` for ``stream``, within its fair share: joined where a rendering of it
        can be, else rendered (``render(slot)`` starts it) in a slot of its own; ``key`` None:
        rendered apart, never joined."""
        slots = self._slots
        while True:
            await slots.room(stream)
            found = self._current(key) if key is not None else None
            if found is not None:
                slots.join(found[0])
                if found[0] in self._kept:  # (kept: this stream holds it now)
                    del self._kept[found[0]]
                    slots.let_go(found[0])
                return Started(*found, True)
            if not self._arena.free and self._kept:  # none free: the oldest kept one goes back
                slots.let_go(self._kept.popitem(last=False)[0])
            slot = await slots.acquire(stream)
            if key is None:
                return Started(slot, self._render(stream, slot, render), False)
            if self._current(key) is None:  # (nobody started it while this stream waited for a slot)
                future = self._render(stream, slot, render)
                old = self._key_at.get(slot)
                if old is not None:  # (the slot's last rendering: its slot went back since)
                    self._drop(old)
                self._by_key[key] = (slot, self._arena.generation(slot), future)
                self._key_at[slot] = key
                future.add_done_callback(functools.partial(self._done, key))
                return Started(slot, future, False)
            self.give(stream, slot)  # and join the one started meanwhile

    def _render(self, stream: StreamSlots, slot: int, render: Callable[[int], asyncio.Future[Rendered]]):
        try:
            return render(slot)
        except BaseException:
            self.give(stream, slot)
            raise

    def give(self, stream: StreamSlots, slot: int) -> None:
        """Gives back a slot no worker writes into any more: kept, held for no stream, where
        ``stream`` is its last holder, its rendering is clean and can be joined, and no take
        waits for a slot; else as the slots take it back."""
        slots = self._slots
        if slots.holders(slot) == 1 and not slots.waiters and self._clean(slot):
            slots.hold(slot)
            self._kept[slot] = None
        slots.give(stream, slot)

    def give_when_done(self, stream: StreamSlots, slot: int, rendering: asyncio.Future) -> None:
        """Gives back ``slot`` now if its rendering is done, else when it is (workers still write there)."""
        if rendering.done():
            self.give(stream, slot)
        else:
            rendering.add_done_callback(lambda _f: self.give(stream, slot))

    def _clean(self, slot: int) -> bool:
        """Whether ``slot`` holds a rendering that can be joined and is done, every sample clean."""
        key = self._key_at.get(slot)
        found = self._current(key) if key is not None else None
        if found is None or found[0] != slot:
            return False
        future = found[1]
        return future.done() and not future.cancelled() and not future.result().errors

    def _done(self, key: ChunkKey, future: asyncio.Future[Rendered]) -> None:
        """A rendering finished: joinable on if every sample rendered cleanly, forgotten if not
        (a later stream renders it again, as it would a chunk never rendered)."""
        found = self._current(key)
        if found is None or found[1] is not future:  # (its slot went back already)
            return
        if future.cancelled() or future.result().errors:
            self._drop(key)
