"""The arena's chunk slots shared fairly among open streams, and ending streams that stop reading.

Invariants:
* A stream holds at most its fair share of the slots: slots / open streams, at least 2, and
  never the last two while it is alone. A stream that opens later gets its share as the
  others write theirs out.
* A slot goes back to the arena only when no worker may still write into it (``give_when_done``).
* A client that does not read writes nothing out, so it would keep its slots forever: a chunk
  left unread for ``stall_timeout`` ends its stream, and so does one left unread for
  ``CONTENDED_STALL`` while another stream waits for a free slot (``send``). The stream's
  client reconnects and re-sends its orders; a reading client's writes wait milliseconds.
* A same-host client that maps the arena (Setup.shared_memory) is lent each chunk's slot
  (``lend``) and gives it back by its ticket (``give_lent``); a lent slot counts among its
  stream's held slots, and the same rule ends a stream whose client keeps one unreleased
  (``check_lent``). Whatever is still lent when the stream ends goes back (``give_all_lent``).

Each stream's counts live in its ``StreamSlots``, which only ``Slots`` changes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from remoteloader.server.shared_memory import Arena

# A stream whose client leaves a chunk unread this long while another stream waits for a
# slot is ended (its client reconnects and re-sends its orders): a client that does not
# read, or reads a chunk a minute, cannot keep the slots it took. A reading client's
# writes wait milliseconds; stall_timeout bounds the uncontended case.
CONTENDED_STALL = 10.0


class Stalled(Exception):
    """The client stopped reading: a chunk waited too long to be sent (see Slots.send); says why."""


class StreamSlots:
    """One stream's part of the slots: how many it holds and how many of its takes wait for one.

    Read by anyone; changed only by ``Slots``.
    """

    def __init__(self) -> None:
        self.held = 0  # slots taken (or being taken past the fair-share check) and not given back
        self.waiting = 0  # takes of this stream waiting for a free slot
        # Slots lent to the client (shared memory): ticket -> (slot, time.monotonic() when
        # lent), oldest first; each also counts in ``held``.
        self.lent: dict[int, tuple[int, float]] = {}
        self.last_ticket = 0


class Slots:
    """Hands out the arena's slots within each stream's fair share, and takes them back.

    Args:
        arena: The shared slots.
        open_streams: The number of streams open now (StreamAdmission.active).
        stall_timeout: Seconds a chunk may wait to be read before its stream is ended.
    """

    def __init__(self, arena: Arena, open_streams: Callable[[], int], stall_timeout: float):
        self.arena = arena
        self._open_streams = open_streams
        self.stall_timeout = stall_timeout
        self._freed = asyncio.Condition()
        self._waiters = 0  # takes waiting for a free slot, all streams together

    def fair_share(self) -> int:
        """Most slots one stream may hold now."""
        count = self.arena.count
        return max(2, min(count - 2, count // max(1, self._open_streams())))

    async def take(self, stream: StreamSlots) -> int:
        """A slot for ``stream``, once it is within its fair share and one is free."""
        while stream.held >= self.fair_share():
            async with self._freed:
                await self._freed.wait()
        stream.held += 1
        # While none is free, the streams that hold slots and do not read are ended (send).
        self._waiters += 1
        stream.waiting += 1
        try:
            return await self.arena.acquire()
        finally:
            self._waiters -= 1
            stream.waiting -= 1

    def give(self, stream: StreamSlots, slot: int) -> None:
        """Gives back a slot no worker writes into any more."""
        stream.held -= 1
        self.arena.release(slot)
        asyncio.ensure_future(self._notify_freed())

    def give_when_done(self, stream: StreamSlots, slot: int, rendering: asyncio.Future) -> None:
        """Gives back ``slot`` now if its rendering is done, else when it is (workers still write there)."""
        if rendering.done():
            self.give(stream, slot)
        else:
            rendering.add_done_callback(lambda _f: self.give(stream, slot))

    def lend(self, stream: StreamSlots, slot: int) -> int:
        """Lends a rendered chunk's slot to the stream's client, which maps the arena; its ticket."""
        stream.last_ticket += 1
        stream.lent[stream.last_ticket] = (slot, time.monotonic())
        return stream.last_ticket

    def give_lent(self, stream: StreamSlots, ticket: int) -> bool:
        """Gives back the slot lent under ``ticket``; False when the stream has no such loan."""
        loan = stream.lent.pop(ticket, None)
        if loan is None:
            return False
        self.give(stream, loan[0])
        return True

    def give_all_lent(self, stream: StreamSlots) -> None:
        """Gives back every slot still lent (the stream ends): their generations change."""
        while stream.lent:
            self.give(stream, stream.lent.popitem()[1][0])

    def check_lent(self, stream: StreamSlots) -> None:
        """Raises Stalled when the stream's client has kept a lent slot as long as ``send``
        lets a chunk wait unread."""
        if stream.lent:
            _slot, since = next(iter(stream.lent.values()))
            reason = self._stalled(stream, time.monotonic() - since)
            if reason:
                raise Stalled(f"released no shared chunk for {reason}")

    def _stalled(self, stream: StreamSlots, waited: float) -> str | None:
        """Why ``stream`` is stalled after waiting ``waited`` seconds on its client, or None."""
        if waited >= self.stall_timeout:
            return f"stall_timeout={self.stall_timeout:g}s"
        if waited >= CONTENDED_STALL and self._waiters > stream.waiting:
            return f"{waited:.0f}s while streams waited for the chunk slots it holds"
        return None

    async def _notify_freed(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    async def send(self, write: Awaitable[object], stream: StreamSlots) -> None:
        """Awaits ``write`` (a chunk's), or cancels it and raises Stalled when the client leaves it
        unread for stall_timeout, or for CONTENDED_STALL while another stream waits for a free slot."""
        writing = asyncio.ensure_future(write)
        started = time.monotonic()
        stall = self.stall_timeout
        try:
            while not (await asyncio.wait({writing}, timeout=min(1.0, stall)))[0]:
                reason = self._stalled(stream, time.monotonic() - started)
                if reason:
                    raise Stalled(f"read nothing for {reason}")
        except BaseException:  # stalled, or this stream is ending: the write must not outlive it
            writing.cancel()
            raise
        writing.result()
