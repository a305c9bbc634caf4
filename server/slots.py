"""The arena's chunk slots shared fairly among open streams.

Invariants:
* A stream holds at most its fair share of the slots: its job's share by weight (the jobs'
  weights over the open streams' jobs, as the decode queue shares the workers:
  server.fair_queue), split evenly among the job's streams; at least 2, and never the last
  two while it is alone. A job the operator did not weigh (``--job-weights``) weighs 1 for
  each stream it has open, so that with no weights given every stream's share is slots / open
  streams, named or not; a job the operator weighed weighs that, however many streams it
  has. A stream that opens later gets its share as the others write theirs out.
* A slot goes back to the arena only when no worker may still write into it (its holders give
  it back once its rendering is done: server.sharing's ``give_when_done``).
* A stream whose client stops reading is ended by the stall rules (server.stalls), which read
  ``waiters``; a same-host client's loans of slots (server.local_socket's ``Loans``) count
  among its stream's held slots until it releases them.
* Several streams may hold one slot (a rendering they share, server.sharing): each holds it
  as if it were its own (``join``, within its fair share), and it goes back to the arena
  once the last holder gives it back. Sharing may hold a slot for no stream (``hold``: a
  kept rendering, which sharing alone decides to keep and to let go); it counts as a holder,
  in no stream's share. A slot that goes back to the arena gets a new generation, by which
  server.sharing tells that its rendering can no longer be joined.

Each stream's counts live in its ``StreamSlots``, which only ``Slots`` changes.
"""

from __future__ import annotations

import asyncio

from remoteloader.server.jobs import Jobs
from remoteloader.server.shared_memory import Arena


class StreamSlots:
    """One stream's part of the slots: its job's name, how many it holds and how many of its
    takes wait for one.

    Read by anyone; changed only by ``Slots``.
    """

    def __init__(self, job: str) -> None:
        self.job = job
        self.held = 0  # slots taken (or being taken past the fair-share check) and not given back
        self.waiting = 0  # takes of this stream waiting for a free slot


class Slots:
    """Hands out the arena's slots within each stream's fair share, and takes them back.

    Args:
        arena: The shared slots.
        jobs: The job registry (server.jobs), which the decode queue reads too; the slots open
            and close the streams' jobs in it.
    """

    def __init__(self, arena: Arena, jobs: Jobs | None = None):
        self.arena = arena
        self.jobs = jobs if jobs is not None else Jobs()
        self._freed = asyncio.Condition()
        self._waiters = 0  # takes waiting for a free slot, all streams together
        self._holders: dict[int, int] = {}  # slot -> its holders (streams, and sharing where it keeps it)

    def open(self, job: str) -> StreamSlots:
        """A stream of ``job`` opens (after its Setup): registered in the job registry; its counts,
        to ``close`` when it ends."""
        self.jobs.open(job)
        return StreamSlots(job)

    def close(self, stream: StreamSlots) -> None:
        """The stream has ended (its slots given back or to be given back as workers finish)."""
        self.jobs.close(stream.job)
        asyncio.ensure_future(self._notify_freed())  # (the others' shares grew)

    def fair_share(self, stream: StreamSlots) -> int:
        """Most slots ``stream`` may hold now."""
        count, jobs, job = self.arena.count, self.jobs, stream.job
        return max(2, min(count - 2, int(count * jobs.weight(job) / jobs.total() / jobs.streams(job))))

    @property
    def waiters(self) -> int:
        """Takes waiting for a free slot, all streams together (the stall rules read it)."""
        return self._waiters

    async def room(self, stream: StreamSlots) -> None:
        """Returns once ``stream`` is within its fair share, counting the slot it takes or joins next."""
        while stream.held >= self.fair_share(stream):
            async with self._freed:
                await self._freed.wait()
        stream.held += 1

    async def acquire(self, stream: StreamSlots) -> int:
        """A free slot for ``stream`` (after ``room``), held by it alone."""
        # While none is free, the streams that hold slots and do not read are ended (send).
        self._waiters += 1
        stream.waiting += 1
        try:
            slot = await self.arena.acquire()
        finally:
            self._waiters -= 1
            stream.waiting -= 1
        self._holders[slot] = 1
        return slot

    def join(self, slot: int) -> None:
        """The stream (after ``room``) holds ``slot`` too: a rendering held, shared."""
        self._holders[slot] += 1

    def holders(self, slot: int) -> int:
        """How many hold ``slot`` now (0: it is in the arena)."""
        return self._holders.get(slot, 0)

    def hold(self, slot: int) -> None:
        """Holds ``slot`` (held now) for no stream: it stays out of the arena until ``let_go``."""
        assert slot in self._holders, "only a held slot is held on"
        self._holders[slot] += 1

    def let_go(self, slot: int) -> None:
        """Ends a ``hold``: the slot goes back to the arena if no stream holds it."""
        self._unhold(slot)

    def give(self, stream: StreamSlots, slot: int) -> None:
        """Gives back a slot no worker writes into any more."""
        stream.held -= 1
        self._unhold(slot)
        asyncio.ensure_future(self._notify_freed())

    def _unhold(self, slot: int) -> None:
        """One holder fewer; the last sends the slot back to the arena (its generation changes)."""
        holders = self._holders[slot] - 1
        if holders:
            self._holders[slot] = holders
        else:
            del self._holders[slot]
            self.arena.release(slot)

    async def _notify_freed(self) -> None:
        async with self._freed:
            self._freed.notify_all()
