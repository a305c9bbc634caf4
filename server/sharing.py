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
  while the slot is kept (server.slots: a kept slot is the first to go back when a take
  finds none free). One with a failed sample is not joined once done (a transient failure
  is tried again). A stream that comes later renders its own.
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
    """The renderings streams may join, by key; the one place a stream gets a chunk's slot.

    A rendering is known by its key with its slot and that slot's generation when it started:
    it can be joined while the slot still has that generation (a slot that went back to the
    arena has a new one), so no one needs to tell this class when a slot goes back.

    Args:
        slots: The arena's slots; told to keep clean renderings, it says when a slot goes back.
    """

    def __init__(self, slots: Slots):
        self._slots = slots
        self._arena = slots.arena
        self._by_key: dict[ChunkKey, tuple[int, int, asyncio.Future[Rendered]]] = {}  # (slot, generation, future)
        self._key_at: dict[int, ChunkKey] = {}  # slot -> the key it was last rendered for (at most one a slot)

    def __len__(self) -> int:
        """Renderings that can be joined now."""
        return sum(self._current(key) is not None for key in list(self._by_key))

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
                return Started(*found, True)
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
            slots.give(stream, slot)  # and join the one started meanwhile

    def _render(self, stream: StreamSlots, slot: int, render: Callable[[int], asyncio.Future[Rendered]]):
        try:
            return render(slot)
        except BaseException:
            self._slots.give(stream, slot)
            raise

    def _done(self, key: ChunkKey, future: asyncio.Future[Rendered]) -> None:
        """A rendering finished: kept for later sharers if every sample rendered cleanly, forgotten
        if not (a later stream renders it again, as it would a chunk never rendered)."""
        found = self._current(key)
        if found is None or found[1] is not future:  # (its slot went back already)
            return
        if not future.cancelled() and not future.result().errors:
            self._slots.keepable(found[0])
        else:
            self._drop(key)
