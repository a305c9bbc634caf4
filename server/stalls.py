"""The stall rules: when a stream whose client stops reading (or keeps lent chunks) is ended.

A client that does not read writes nothing out, so it would keep its chunk slots forever: a
chunk left unread for ``stall_timeout`` ends its stream, and so does one left unread for
``CONTENDED_STALL`` while another stream waits for a free slot (``Stalls.send``). The same rule
ends a same-host stream whose client keeps a lent slot unreleased (server.local_socket's
``Loans.check``). The stream's client reconnects and re-sends its orders; a reading client's
writes wait milliseconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from remoteloader.server.slots import Slots, StreamSlots

# A stream whose client leaves a chunk unread this long while another stream waits for a
# slot is ended (its client reconnects and re-sends its orders): a client that does not
# read, or reads a chunk a minute, cannot keep the slots it took. A reading client's
# writes wait milliseconds; stall_timeout bounds the uncontended case.
CONTENDED_STALL = 10.0


class Stalled(Exception):
    """The client stopped reading: a chunk waited too long to be sent (see Stalls.send); says why."""


class Stalls:
    """The stall rules over a server's slots.

    Args:
        slots: The shared slots (how many takes wait for one, and whose).
        stall_timeout: Seconds a chunk may wait to be read before its stream is ended.
    """

    def __init__(self, slots: Slots, stall_timeout: float):
        self.slots = slots
        self.stall_timeout = stall_timeout

    def why(self, stream: StreamSlots, waited: float) -> str | None:
        """Why ``stream`` is stalled after waiting ``waited`` seconds on its client, or None."""
        if waited >= self.stall_timeout:
            return f"stall_timeout={self.stall_timeout:g}s"
        if waited >= CONTENDED_STALL and self.slots.waiters > stream.waiting:
            return f"{waited:.0f}s while streams waited for the chunk slots it holds"
        return None

    async def send(self, write: Awaitable[object], stream: StreamSlots) -> None:
        """Awaits ``write`` (a chunk's), or cancels it and raises Stalled when the client leaves it
        unread for stall_timeout, or for CONTENDED_STALL while another stream waits for a free slot."""
        writing = asyncio.ensure_future(write)
        started = time.monotonic()
        stall = self.stall_timeout
        try:
            while not (await asyncio.wait({writing}, timeout=min(1.0, stall)))[0]:
                reason = self.why(stream, time.monotonic() - started)
                if reason:
                    raise Stalled(f"read nothing for {reason}")
        except BaseException:  # stalled, or this stream is ending: the write must not outlive it
            writing.cancel()
            raise
        writing.result()
