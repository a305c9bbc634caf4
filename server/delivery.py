"""How a stream's chunks reach its client: in the gRPC message, or left in the shared memory.

The order stream (server.order_stream) asks its delivery at each point where the two differ;
this module is the one place that knows how they differ:
* ``PayloadDelivery``: a chunk's pixels travel in its message; its slot goes back once it is
  written. A Release ends the stream (the client never asked for shared memory).
* ``SharedDelivery`` (Setup.shared_memory, a same-host client that maps the arena): a chunk
  goes out as its header alone, ChunkHeader.shared saying where its pixels lie, and its slot
  is lent to the client (local_socket.Loans) until a Release names its ticket, or the stream
  ends. A client that keeps a slot unreleased is ended as one that does not read is, whether
  or not the stream has anything to write meanwhile. A stream that fails (the client's
  Releases are then no longer read) ends at once, ahead of the chunks that would wait for
  its slots; one that drains ends once the client has released what it was lent, and reads
  on meanwhile, for the Releases.
"""

from __future__ import annotations

import asyncio
from typing import Any

from remoteloader.protos import loader_pb2
from remoteloader.server.config import ServerConfig
from remoteloader.server.local_socket import Loans
from remoteloader.server.shared_memory import Arena
from remoteloader.server.sharing import SharedRenders
from remoteloader.server.slots import StreamSlots
from remoteloader.server.stalls import Stalls

_EMPTY = memoryview(b"")


class PayloadDelivery:
    """Chunks whose pixels travel in their gRPC messages."""

    reads_releases = False  # (a draining stream stops reading the client)

    def chunk_bytes(self, config: ServerConfig) -> int:
        """Most bytes of a chunk of this stream."""
        return config.stream_chunk_bytes(False)

    async def next(self, queue: asyncio.Queue) -> Any:
        """The next item the stream writes."""
        return await queue.get()

    def fail(self, end: Any, queue: asyncio.Queue) -> None:
        """The stream fails with ``end``: it ends after the chunks already started."""

    async def before_end(self, end: Any) -> None:
        """Returns once the stream may end with ``end``."""

    def release(self, release: loader_pb2.Release) -> str | None:
        """Why a Release ends the stream."""
        return "Release on a stream whose Setup did not ask for shared_memory"

    def lend(self, slot: int) -> int | None:
        """A rendered chunk's slot, about to be written: not lent (None), it goes back once written."""
        return None

    def place(self, header: loader_pb2.ChunkHeader, slot: int, nbytes: int, ticket: int | None, pixels):
        """The pixels the chunk's message carries: all of them."""
        return pixels

    def end(self) -> None:
        """The stream has ended."""


class SharedDelivery:
    """Chunks left in the shared memory a same-host client maps, their slots lent to it.

    Args:
        stalls: The server's stall rules.
        renders: Where the slots lent go back.
        stream: The stream's part of the slots.
        arena: The shared memory the client maps.
    """

    reads_releases = True  # (a draining stream reads on, for the client's Releases)

    def __init__(self, stalls: Stalls, renders: SharedRenders, stream: StreamSlots, arena: Arena):
        self._stalls = stalls
        self._loans = Loans(stalls, renders, stream)
        self._arena = arena
        self._failed: Any = None  # how the stream ends, ahead of its chunks

    def chunk_bytes(self, config: ServerConfig) -> int:
        """Most bytes of a chunk of this stream."""
        return config.stream_chunk_bytes(True)

    async def next(self, queue: asyncio.Queue) -> Any:
        """The next item to write; raises Stalled once the client has kept a lent slot too long,
        whether or not the stream has anything to write meanwhile."""
        while True:
            if self._failed is not None:
                return self._failed
            self._loans.check()
            try:
                return await asyncio.wait_for(queue.get(), min(1.0, self._stalls.stall_timeout))
            except asyncio.TimeoutError:
                pass

    def fail(self, end: Any, queue: asyncio.Queue) -> None:
        """The stream fails with ``end``: at once, as the client's Releases are no longer read,
        so chunks that wait for its slots would never come."""
        if self._failed is None:
            self._failed = end
            queue.put_nowait(end)  # (wakes next)

    async def before_end(self, end: Any) -> None:
        """Returns once the stream may end with ``end``: when it drains, once the client has
        released every slot lent to it (the stall rules apply)."""
        if end is self._failed:
            return
        while self._loans and self._failed is None:
            self._loans.check()
            await asyncio.sleep(0.01)

    def release(self, release: loader_pb2.Release) -> str | None:
        """Gives back the slots the client has copied out of; why the stream must end, or None."""
        for ticket in release.tickets:
            if not self._loans.give_back(ticket):
                return f"Release of ticket {ticket}, which this stream does not hold (never sent, or released already)"
        return None

    def lend(self, slot: int) -> int | None:
        """Lends a rendered chunk's slot to the client (before its write: the client may release
        it before the write returns); its ticket."""
        return self._loans.lend(slot)

    def place(self, header: loader_pb2.ChunkHeader, slot: int, nbytes: int, ticket: int | None, pixels):
        """Says in ``header`` where the chunk's raw pixels (pipeline_checks) lie in the slot the
        client maps; the message carries none of them."""
        assert ticket is not None, "a shared chunk's slot is lent before it is written"
        arena = self._arena
        header.shared.offset = arena.offset(slot)
        header.shared.length = nbytes
        header.shared.ticket = ticket
        header.shared.generation_offset = arena.generation_offset(slot)
        header.shared.generation = arena.generation(slot)
        return _EMPTY

    def end(self) -> None:
        """The stream has ended: every slot still lent goes back (those no other stream holds or
        keeps change generation: a copy under way fails)."""
        self._loans.give_all()
